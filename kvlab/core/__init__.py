"""The bottom layer: what a model's attention is and how it is computed, budgets, results, cancel.

Model value types (``model``), attention semantics and arithmetic (``semantics``,
``attention_ops``), rotary embeddings (``rope``), budgets and bytes (``budgets``), the result types
every layer reports in (``results``) and cooperative cancellation (``cancel``). It imports nothing
of kvlab but ``kernels``.
"""
