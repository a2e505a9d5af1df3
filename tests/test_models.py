import json
import os

import pytest

from kvlab.core.model import ModelLoadError
from kvlab.engine import embedded
from kvlab.engine.loader import load_model, local_models, verdict_of


def test_embedded_model_shape_and_chat_template(lm):
    info = lm.info
    assert (info.n_layers, info.n_heads, info.n_kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert info.device == "cpu" and info.dtype == "float32"
    ids = lm.encode("hello")
    raw = lm.encode("hello", chat=False)
    assert len(ids) > len(raw)  # the chat template wraps the message
    assert "<|im_start|>user" in lm.tokenizer.decode(ids)


def test_loading_twice_is_cached(lm):
    assert load_model("embedded") is lm


def test_missing_folder_gives_one_clear_line(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path / "nope"))
    msg = str(err.value)
    assert "\n" not in msg and "nope" in msg


def test_not_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert", "architectures": ["BertForMaskedLM"]}')
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        load_model(str(tmp_path))


def test_bad_dtype():
    with pytest.raises(ModelLoadError, match="allowed"):
        load_model("embedded", dtype="float8")


def test_a_path_that_is_no_folder_says_so_in_one_line():
    for spec in ("/nonexistent", "./no/such", "~/no-such-model-here", "a/b/c"):
        with pytest.raises(ModelLoadError, match=r"^no such folder: ") as err:
            load_model(spec)
        assert "\n" not in str(err.value) and "Repo id" not in str(err.value)
    with pytest.raises(ModelLoadError, match="not a Hugging Face id"):
        load_model("two words")


def test_the_self_check_verdict_is_kept(lm):
    verdict = verdict_of(lm)
    assert verdict is not None and 0 <= verdict.largest <= verdict.bound == 1e-3
    assert (verdict.prefill_tokens, verdict.decode_steps) == (24, 5)
    assert verdict.summary().startswith("self-check passed: kvlab's exact path equals the model's own forward")
    assert verdict_of(lm.with_cache_dtype("float32")) is verdict  # the weights' verdict, whatever the cache dtype


def _hub_repo(hub, kind: str, repo: str, files: dict[str, str]) -> None:
    """A repo in a Hugging Face hub cache laid out as huggingface_hub writes it (blobs, snapshot symlinks, refs)."""
    root = hub / f"{kind}--{repo.replace('/', '--')}"
    rev = "0" * 40
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(rev)
    (root / "blobs").mkdir()
    (root / "snapshots" / rev).mkdir(parents=True)
    for i, (name, text) in enumerate(files.items()):
        blob = root / "blobs" / f"{i:040d}"
        blob.write_text(text)
        (root / "snapshots" / rev / name).symlink_to(os.path.relpath(blob, root / "snapshots" / rev))


LLAMA = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def test_local_models_lists_the_causal_lms_of_both_caches(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "kv"))
    installed = [m.spec for m in embedded.MODELS if m.installed()]  # the embedded models: SmolLM2 first
    assert installed[0] == "embedded"
    assert local_models() == installed  # neither cache exists yet: no error
    hub = tmp_path / "hf" / "hub"
    _hub_repo(hub, "models", "acme/tiny-llama", {"config.json": LLAMA, "model.safetensors": "x"})
    _hub_repo(hub, "models", "acme/bert", {"config.json": '{"architectures": ["BertForMaskedLM"]}'})
    _hub_repo(hub, "models", "acme/t5", {"config.json": '{"architectures": ["T5ForConditionalGeneration"]}'})
    _hub_repo(hub, "models", "acme/gguf-only", {"model.gguf": "x"})
    _hub_repo(hub, "datasets", "acme/data", {"config.json": LLAMA})
    (hub / "models--acme--broken").mkdir()  # no snapshots: huggingface_hub reports it as corrupted
    (hub / "models--acme--garbled" / "snapshots" / "0").mkdir(parents=True)
    (hub / "models--acme--garbled" / "snapshots" / "0" / "config.json").write_text("{not json")
    kv = tmp_path / "kv"
    for folder, config in (("smollm2-135m-instruct", LLAMA), ("my-model", LLAMA), ("notes", None)):
        (kv / folder).mkdir(parents=True)
        if config:
            (kv / folder / "config.json").write_text(config)
    assert local_models() == [*installed, "acme/tiny-llama", str(kv / "my-model")]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # HF_HUB_CACHE wins over HF_HOME
    assert local_models() == [*installed, str(kv / "my-model")]
