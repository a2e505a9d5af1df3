"""The ZeroGPU path: a lease sized to the request, nothing device-resident handed back."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

from kvlab.ui import gpu_lease as gpu


def test_lease_grows_with_the_work_and_is_capped(monkeypatch):
    monkeypatch.delenv("KVLAB_GPU_SECONDS_SCALE", raising=False)
    monkeypatch.setenv("KVLAB_GPU_MAX_SECONDS", "100000")
    small = gpu.WorkSize(prompt_tokens=500, runs=2, new_tokens=16)
    for bigger in (
        gpu.WorkSize(prompt_tokens=4000, runs=2, new_tokens=16),
        gpu.WorkSize(prompt_tokens=500, runs=12, new_tokens=16),
        gpu.WorkSize(prompt_tokens=500, runs=2, new_tokens=256),
    ):
        assert gpu.lease_seconds(bigger) > gpu.lease_seconds(small)
    assert gpu.lease_seconds(gpu.WorkSize(500, 2, 16, probes=False)) < gpu.lease_seconds(small)
    huge = gpu.WorkSize(prompt_tokens=8000, runs=200, new_tokens=4096)
    monkeypatch.setenv("KVLAB_GPU_MAX_SECONDS", "300")
    assert gpu.lease_seconds(huge) == 300
    monkeypatch.setenv("KVLAB_GPU_SECONDS_SCALE", "2.0")
    assert gpu.lease_seconds(small) > gpu.WorkSize(500, 2, 16).seconds() / 2 + gpu.BASE_S / 2


def test_without_spaces_the_function_is_unchanged(monkeypatch):
    monkeypatch.setitem(sys.modules, "spaces", None)  # import fails, as on a machine without it
    fn = lambda x: x  # noqa: E731
    assert gpu.gpu(fn, lambda x: gpu.WorkSize(1, 1, 1)) is fn


@pytest.fixture
def zero_gpu_spaces(monkeypatch):
    """A stand-in for the ``spaces`` package on a ZeroGPU Space: records the durations asked for (and, in
    ``asked.sizes``, the lease sizes); like the real one, it refuses a coroutine function."""

    class Asked(list):
        sizes: list[str | None]

    asked = Asked()
    asked.sizes = sizes = []

    def GPU(duration, size=None):
        sizes.append(size)

        def deco(fn):
            if inspect.iscoroutinefunction(fn):
                raise NotImplementedError

            def run(*args, **kwargs):
                asked.append(duration(*args, **kwargs))
                return fn(*args, **kwargs)

            return run

        return deco

    mod = types.ModuleType("spaces")
    mod.GPU = GPU
    cfg = types.ModuleType("spaces.config")
    cfg.Config = types.SimpleNamespace(zero_gpu=True)
    mod.config = cfg
    monkeypatch.setitem(sys.modules, "spaces", mod)
    monkeypatch.setitem(sys.modules, "spaces.config", cfg)
    return asked


def test_duration_comes_from_the_request(zero_gpu_spaces, monkeypatch):
    monkeypatch.setenv("KVLAB_GPU_MAX_SECONDS", "100000")

    def compare(prompt_tokens, runs):
        yield {"keys": torch.ones(2)}
        yield "done"

    wrapped = gpu.gpu(compare, lambda p, r: gpu.WorkSize(p, r, 32))
    outs = list(wrapped(1000, 3))
    outs += list(wrapped(4000, 12))
    assert zero_gpu_spaces == [
        gpu.lease_seconds(gpu.WorkSize(1000, 3, 32)),
        gpu.lease_seconds(gpu.WorkSize(4000, 12, 32)),
    ]
    assert zero_gpu_spaces[1] > zero_gpu_spaces[0]
    assert outs[1] == "done" and outs[0]["keys"].device.type == "cpu"


def test_a_bad_request_gets_the_smallest_lease(zero_gpu_spaces):
    def work(prompt):
        raise ValueError("bad budget")

    assert gpu.gpu(lambda prompt: "refused", work)("x") == "refused"
    assert zero_gpu_spaces == [int(gpu.BASE_S)]


def test_the_lease_asks_for_the_size_given(zero_gpu_spaces, monkeypatch):
    monkeypatch.delenv("KVLAB_GPU_SIZE", raising=False)
    gpu.gpu(lambda x: x, lambda x: gpu.WorkSize(1, 1, 1))(1)
    monkeypatch.setenv("KVLAB_GPU_SIZE", "xlarge")
    gpu.gpu(lambda x: x, lambda x: gpu.WorkSize(1, 1, 1))(1)
    assert zero_gpu_spaces.sizes == ["large", "xlarge"]  # large (half a card) unless told
    monkeypatch.setenv("KVLAB_GPU_SIZE", "huge")
    with pytest.raises(ValueError, match="allowed: large, xlarge"):
        gpu.gpu(lambda x: x, lambda x: gpu.WorkSize(1, 1, 1))


@pytest.mark.parametrize("on_zero_gpu", [False, True])
def test_async_functions_are_refused_everywhere(on_zero_gpu, request):
    if on_zero_gpu:
        request.getfixturevalue("zero_gpu_spaces")

    async def compare(prompt):
        return prompt

    async def stream(prompt):
        yield prompt

    for fn in (compare, stream):
        with pytest.raises(TypeError, match="async function"):
            gpu.gpu(fn, lambda p: gpu.WorkSize(1, 1, 1))


def test_models_are_placed_on_cuda_at_import_only_on_zero_gpu(monkeypatch, request):
    monkeypatch.setitem(sys.modules, "spaces", None)
    assert gpu.placement_device() is None  # load_model picks: the CPU here
    request.getfixturevalue("zero_gpu_spaces")
    assert gpu.placement_device() == "cuda"


def test_the_page_preloads_every_offered_model_on_its_device(lm, monkeypatch):
    from kvlab.ui import dashboard as dash_mod

    asked = []

    def fake_load(spec, device=None, progress=None, **kw):
        asked.append((spec, device))
        return lm

    monkeypatch.setattr(dash_mod, "load_model", fake_load)
    dash = dash_mod.Dashboard(lm, device="cuda")
    assert dash.preload(["embedded", "gemma3-270m", "other/model"]) == ["embedded", "gemma3-270m", "other/model"]
    assert asked == [("gemma3-270m", "cuda"), ("other/model", "cuda")]  # the first model is held already
    assert set(dash.engines) == {"embedded", "gemma3-270m", "other/model"}  # all held: none freed


def test_host_only_and_tensor_paths():
    from dataclasses import dataclass

    @dataclass
    class Box:
        t: torch.Tensor
        note: str = ""

    t = torch.arange(3.0)
    obj = {"a": [t, (1, t)], "b": Box(t, "x")}
    assert sorted(gpu.tensor_paths(obj)) == [
        "a/0/<tensor on cpu>",
        "a/1/1/<tensor on cpu>",
        "b/t/<tensor on cpu>",
    ]
    moved = gpu.host_only(obj)
    assert torch.equal(moved["b"].t, t) and moved["b"].note == "x"
    assert gpu.tensor_paths({"text": "no tensors", "n": [1, 2.0]}) == []


def test_space_python_version_is_one_zero_gpu_runs():
    """ZeroGPU Spaces run a fixed Python (3.10.13, and 3.12.12 on newer images); the front matter names one."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    front = readme.split("---")[1]
    version = re.search(r'^python_version:\s*"?([\d.]+)"?\s*$', front, re.M).group(1)
    assert version in {"3.10.13", "3.12.12"}
