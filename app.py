"""kvlab dashboard entry point (also the Hugging Face Space's app_file)."""

from __future__ import annotations

import argparse
import os

from kvlab.models import load_model
from kvlab.ui import CSS, build_demo


def main() -> None:
    ap = argparse.ArgumentParser(description="kvlab dashboard")
    ap.add_argument("--host", default=os.environ.get("KVLAB_HOST", "0.0.0.0"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("PORT", os.environ.get("GRADIO_SERVER_PORT", 7860))))
    ap.add_argument("--model", default=os.environ.get("KVLAB_MODEL", "embedded"))
    args = ap.parse_args()
    lm = load_model(args.model)  # loaded once at start
    demo = build_demo(lm)
    demo.queue(default_concurrency_limit=1).launch(server_name=args.host, server_port=args.port, css=CSS)


if __name__ == "__main__":
    main()
