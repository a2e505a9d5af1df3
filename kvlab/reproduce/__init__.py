"""``python -m kvlab reproduce NAME|all``: each paper's claim measured on the embedded model.

One module per reproduction (``run(ctx) -> Report``); ``REPRODUCTIONS`` is the registry and
``runner`` runs them, prints the tables and writes JSON + HTML. See docs/reproductions.md.
"""

from __future__ import annotations

from kvlab.reproduce.common import Claim, Report, Row, papers_dir
from kvlab.reproduce.registry import REPRODUCTIONS, get_reproduction, names
from kvlab.reproduce.setup import ReproductionSetup

__all__ = ["REPRODUCTIONS", "Claim", "Report", "ReproductionSetup", "Row", "get_reproduction", "names", "papers_dir"]
