"""Choosing a model on the page: which models it offers, loading one with its self-check verdict, refusals.

Real loads only: tiny random-weight models saved to temporary folders (``save_tiny``), with the
embedded model's tokenizer, and the embedded model itself as the page's first model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("gradio")

import gradio as gr  # noqa: E402

from bench.tiny_models import build  # noqa: E402
from kvlab.engine import embedded  # noqa: E402
from kvlab.engine.specs import InputError  # noqa: E402
from kvlab.ui import Dashboard, Limits, PageInputs  # noqa: E402
from kvlab.ui.config import fixed_models, model_choice_allowed  # noqa: E402


def save_tiny(folder: Path, seed: int = 0) -> Path:
    """A tiny random-weight Llama (4 layers, hidden 128) and the embedded model's tokenizer, saved in ``folder``."""
    from transformers import AutoTokenizer

    from kvlab.engine.loader import embedded_model_dir

    build("llama", seed=seed).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(embedded_model_dir())).save_pretrained(folder)
    return folder


def save_encoder_decoder(folder: Path) -> Path:
    """A tiny random-weight T5 (an architecture kvlab refuses), saved in ``folder``."""
    import transformers as tf

    config = tf.T5Config(vocab_size=128, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    tf.T5ForConditionalGeneration(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "env, allowed",
    [
        ({}, True),  # a local run
        ({"SPACE_ID": "someone/kvlab"}, False),  # a Hugging Face Space
        ({"SPACE_ID": "someone/kvlab", "KVLAB_ALLOW_MODEL_CHOICE": "1"}, True),
        ({"KVLAB_ALLOW_MODEL_CHOICE": "0"}, False),  # the fixed list forced on a local run
        ({"KVLAB_ALLOW_MODEL_CHOICE": "no"}, False),
        ({"KVLAB_ALLOW_MODEL_CHOICE": "maybe"}, True),  # not a yes or a no: the default
    ],
)
def test_who_may_choose_a_model(env, allowed):
    assert model_choice_allowed(env) is allowed


INSTALLED = tuple(m.spec for m in embedded.MODELS if m.installed())  # both, where requirements-model.txt went in


def test_the_fixed_list():
    assert INSTALLED[0] == "embedded"
    assert fixed_models({}) == INSTALLED
    assert fixed_models({"KVLAB_MODELS": " embedded, acme/tiny ,acme/tiny"}) == ("embedded", "acme/tiny")


class Stages(list):
    """Records a load's progress calls as (fraction, stage)."""

    def __call__(self, fraction, desc=None, **kw):
        self.append((fraction, desc))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def test_load_a_folder_with_progress_and_the_verdict(lm, tiny_dir, tmp_path):
    dash = Dashboard(lm, Limits(allow_model_choice=True))
    stages = Stages()
    box, state, line, layer, head = dash.choose_model(str(tiny_dir), "embedded", progress=stages)
    assert state == str(tiny_dir) and box["value"] == str(tiny_dir) and str(tiny_dir) in box["choices"]
    assert "self-check passed: kvlab&#x27;s exact path equals the model&#x27;s own forward" in line
    assert "4 layers, 4 query / 2 KV heads, head_dim 32" in line
    assert (layer["value"], layer["maximum"], head["maximum"]) == (2, 3, 3)
    assert [d for _, d in stages][-1].startswith("self-check")
    assert [f for f, _ in stages] == sorted(f for f, _ in stages)
    # the plan line now sizes the tiny model; a comparison runs on it
    inputs = PageInputs(str(tiny_dir), "Name a colour.", [], ["streaming"], "0.5", 3, 0, None, False)
    engine, comparison, n = dash.request(inputs, load=False)
    assert engine.info.n_layers == 4 and engine.lm.info.id == str(tiny_dir)
    assert "2 runs on" in dash.plan(*[getattr(inputs, f) for f in PageInputs.__dataclass_fields__])
    # a refused model: one line, the box back on the session's model, which stays loaded
    t5 = save_encoder_decoder(tmp_path / "t5")
    box, state, line, layer, head = dash.choose_model(str(t5), str(tiny_dir), progress=Stages())
    assert state == str(tiny_dir) and box["value"] == str(tiny_dir)
    assert "encoder-decoder" in line and "nothing was lost" in line and str(tiny_dir) in line
    assert layer == gr.skip() and head == gr.skip()
    assert set(dash.engines) == {"embedded", str(tiny_dir)}
    box, state, line, *_ = dash.choose_model(str(tmp_path / "missing"), str(tiny_dir), progress=Stages())
    assert state == str(tiny_dir) and "no such folder" in line
    assert dash.request(inputs, load=False)[0] is engine  # still loaded, the same engine


def test_a_later_model_frees_the_one_before_but_never_the_first(lm, tiny_dir, tmp_path):
    from kvlab.engine import loader

    dash = Dashboard(lm, Limits(allow_model_choice=True))
    other = save_tiny(tmp_path / "other", seed=1)
    dash.choose_model(str(tiny_dir), "embedded", progress=Stages())
    first = dash.engines[str(tiny_dir)].lm
    dash.choose_model(str(other), str(tiny_dir), progress=Stages())
    assert list(dash.engines) == ["embedded", str(other)]
    assert all(v.model is not first.model for v in loader._LOADED.values())  # its weights are forgotten
    assert dash.engines["embedded"].lm is lm


def test_the_plan_line_does_not_load(lm, tiny_dir):
    dash = Dashboard(lm, Limits(allow_model_choice=True))
    inputs = PageInputs(str(tiny_dir) + "/", "Name a colour.", [], ["streaming"], "0.5", 3, 0, None, False)
    plan = dash.plan(*[getattr(inputs, f) for f in PageInputs.__dataclass_fields__])
    assert "is not loaded yet: press Load model" in plan
    assert list(dash.engines) == ["embedded"]


def test_a_fixed_list_refuses_any_other_model(lm, tiny_dir):
    dash = Dashboard(lm, Limits(allow_model_choice=False, models=("embedded",)))
    with pytest.raises(InputError, match=r"fixed list of models \(embedded\)"):
        dash.engine_for(str(tiny_dir))
    box, state, line, *_ = dash.choose_model(str(tiny_dir), "embedded", progress=Stages())
    assert state == "embedded" and "fixed list" in line
    assert dash.offered() == ["embedded"]
    assert list(dash.engines) == ["embedded"]


def test_the_page_offers_this_machines_models_or_the_fixed_list(lm, tmp_path, monkeypatch):
    from kvlab.ui.page import model_box

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "kv"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    mine = tmp_path / "kv" / "mine"
    mine.mkdir(parents=True)
    (mine / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    with gr.Blocks():
        free, load, line, state = model_box(lm, Limits(allow_model_choice=True))
        fixed, fixed_load, _, _ = model_box(lm, Limits(allow_model_choice=False, models=("embedded",)))
    assert [c[1] for c in free.choices] == [*INSTALLED, str(mine)] and free.allow_custom_value and load.visible
    assert "self-check passed" in line.value and state.value == "embedded"
    assert [c[1] for c in fixed.choices] == ["embedded"] and not fixed.allow_custom_value
    assert not fixed.interactive and not fixed_load.visible
