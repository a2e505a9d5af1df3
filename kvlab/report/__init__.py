"""Figures and files drawn from results: the shared charts and their axes (``charts``), a
comparison's figures (``comparison_figures``), needle grids, the leaderboard, the sweep's HTML
report and the result-file reader. This layer imports only ``kvlab.core``."""
