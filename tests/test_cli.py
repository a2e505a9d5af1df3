import json
import subprocess
import sys

import pytest

from kvlab.cli import main


def _run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["compare", "--prompt", "hi", "--methods", "nope"], "allowed"),
        (["compare", "--prompt", "hi", "--budget", "1.5"], "outside (0, 1]"),
        (["compare", "--prompt", "   "], "empty"),
        (["compare", "--prompt-file", "/nonexistent/file.txt"], "cannot read"),
        (["compare", "--prompt", "hi", "--param", "streaming.bogus=1"], "unknown parameter"),
        (["compare", "--prompt", "hi", "--param", "oops"], "METHOD.NAME=VALUE"),
        (["compare", "--prompt", "hi", "--max-new-tokens", "0"], "allowed"),
        (["compare", "--prompt", "hi", "--bogus-flag"], "unrecognized"),
        (["compare", "--prompt", "hi", "--cache-dtype", "int8"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, needle, capsys):
    code, out, err = _run(args, capsys)
    assert code == 2
    assert err.count("\n") == 1 and needle in err, err


def test_compare_writes_json(tmp_path, capsys, lm):
    path = tmp_path / "r.json"
    code, out, err = _run(
        [
            "compare",
            "--prompt",
            "Name a colour.",
            "--methods",
            "exact,streaming",
            "--budget",
            "0.5,0.25",
            "--max-new-tokens",
            "6",
            "--json",
            str(path),
            "--quiet",
        ],
        capsys,
    )
    assert code == 0, err
    data = json.loads(path.read_text())
    assert data["model"]["n_layers"] == lm.info.n_layers and data["model"]["head_dim"] == lm.info.head_dim
    assert data["model"]["cache_dtype"] == "float16"  # the 16-bit default on the CPU
    assert data["prompt_token_ids"] == lm.encode("Name a colour.")
    assert data["prompt_tokens"] == len(data["prompt_token_ids"])
    assert set(data["timings"]) >= {"load_s", "compare_s"}
    assert [r["method"] for r in data["runs"]] == ["exact", "streaming", "streaming"]
    for r in data["runs"]:
        assert set(r) >= {
            "method",
            "budget",
            "params",
            "text",
            "token_ids",
            "kv_bytes",
            "kv_bytes_per_step",
            "exact_kv_bytes_per_step",
            "timings",
        }
        assert set(r["timings"]) >= {"prefill_s", "compress_s", "decode_s", "tokens_per_s"}
    assert "streaming@0.25" in out


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "kvlab", "methods"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "streaming" in proc.stdout and "n_sink" in proc.stdout


def test_cache_dtype_flag_sets_the_memory_axis(tmp_path, capsys):
    path = tmp_path / "r32.json"
    args = ["compare", "--prompt", "Hi.", "--methods", "exact", "--max-new-tokens", "2", "--quiet"]
    code, _, err = _run([*args, "--cache-dtype", "float32", "--json", str(path)], capsys)
    assert code == 0, err
    data = json.loads(path.read_text())
    n = data["prompt_tokens"]
    assert data["model"]["cache_dtype"] == "float32"
    assert data["runs"][0]["kv_bytes"] == 30 * 3 * n * 64 * 2 * 4


def test_a_missing_model_folder_exits_2_with_one_line(capsys):
    code, out, err = _run(["compare", "--prompt", "hi", "--model", "/nonexistent"], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "no such folder: '/nonexistent'" in err, err
    assert "Repo id" not in err


def _tiny_refused(kind: str, folder):
    """A tiny random-weight model of an architecture kvlab refuses, saved with ``save_pretrained``."""
    import transformers as tf

    if kind == "encoder-decoder":
        config = tf.T5Config(vocab_size=128, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
        model = tf.T5ForConditionalGeneration(config)
    else:
        config = tf.MambaConfig(vocab_size=128, hidden_size=16, state_size=4, num_hidden_layers=1)
        model = tf.MambaForCausalLM(config)
    model.save_pretrained(folder)


@pytest.mark.parametrize("kind, why", [("encoder-decoder", "encoder-decoder"), ("state-space", "state-space")])
def test_a_refused_architecture_exits_2_with_one_line(kind, why, tmp_path, capsys):
    _tiny_refused(kind, tmp_path / kind)
    capsys.readouterr()  # save_pretrained's progress bar
    code, out, err = _run(["compare", "--prompt", "hi", "--model", str(tmp_path / kind)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "kvlab cannot run" in err and why in err, err


def test_a_sweep_with_a_missing_model_exits_2_with_one_line(tmp_path, capsys):
    args = ["sweep", "--model", "./no/such/model", "--methods", "exact", "--out", str(tmp_path), "--quiet"]
    code, out, err = _run(args, capsys)
    assert code == 2
    assert err.count("\n") == 1 and "no such folder: './no/such/model'" in err, err
