"""Running methods on a real model: the loader and its self-check, the attention hook, the caches
handed to transformers, the shared prefill, the lockstep decode, questions after compression,
planning, faults and probes, and ``comparison.Engine``, which strings them together.

It imports ``kvlab.core`` and ``kvlab.methods``; nothing here imports a layer above it.
"""
