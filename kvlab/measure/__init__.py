"""Measurements of runs: attention error against a shadow exact cache, teacher-forced fidelity,
text similarity (``metrics``), and the health flags of a run (``health``)."""
