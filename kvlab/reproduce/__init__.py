"""``python -m kvlab reproduce NAME|all``: the papers' claims measured on the embedded model.

One module per reproduction (``run(ctx) -> Report``), each declaring the registry entries its rows bear on
(``DECLARED``: paper claims, implementation checks, controls; ``kvlab.reproduce.claims``);
``REPRODUCTIONS`` lists them and ``runner`` runs them, prints the tables and writes JSON + HTML and the
summary that docs/reproductions.md and the README's tally are generated from (``kvlab.reproduce.docs``).
"""

from __future__ import annotations

from kvlab.reproduce.common import Claim, Row, papers_dir
from kvlab.reproduce.registry import REPRODUCTIONS, get_reproduction, names
from kvlab.reproduce.report import Report
from kvlab.reproduce.setup import ReproductionSetup

__all__ = ["REPRODUCTIONS", "Claim", "Report", "ReproductionSetup", "Row", "get_reproduction", "names", "papers_dir"]
