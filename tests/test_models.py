import pytest

from kvlab.core.model import ModelLoadError
from kvlab.engine.loader import load_model


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
