"""Shared fixtures: the embedded model is converted once per machine and loaded once per test run."""

from __future__ import annotations

import os
import socket
import zlib

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP, as kvlab/__init__.py does
import torch  # noqa: E402

os.environ.setdefault("KVLAB_THREADS", "2")  # pinned: results repeat bit for bit (kvlab.core.threads)
torch.set_num_threads(int(os.environ["KVLAB_THREADS"]))


@pytest.fixture(autouse=True)
def _seeded(request):
    """Each test draws the same random tensors on every run: seeded from its own id, so one test's
    draws do not depend on which tests ran before it in the same worker."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port():
    """A function that returns a free TCP port of 127.0.0.1 (for a test's server)."""
    return _free_port


@pytest.fixture(scope="session")
def lm():
    from kvlab.engine.loader import load_model

    return load_model("embedded")


@pytest.fixture(scope="session")
def engine(lm):
    from kvlab.engine.comparison import Engine

    return Engine(lm)


@pytest.fixture(scope="session")
def engine32(lm):
    """The engine with float32 caches: exact then equals transformers' ``generate`` token for token."""
    from kvlab.engine.comparison import Engine

    return Engine(lm.with_cache_dtype("float32"))


@pytest.fixture(scope="session")
def long_text():
    """Real prose from CPython's reference manual (offline), for long prompts."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in ("assert", "assignment", "atom-identifiers", "attribute-access", "augassign"))


@pytest.fixture(scope="session")
def prefill_state(lm, long_text):
    """A real prefill of ~600 tokens with the last 64 queries and accumulated attention."""
    from kvlab.engine.prefill import prefill
    from kvlab.methods.handover import PrefillNeeds

    ids = lm.encode(long_text[:3000])
    state, _ = prefill(lm, ids, PrefillNeeds(query_window=64, acc_attn=True))
    return state


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA and the compiled Triton path; without a GPU they are skipped."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (compiled Triton path)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
