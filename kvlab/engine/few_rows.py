"""Linear layers for a few rows on the CPU, as W @ x^T instead of x @ W^T.

A lockstep decode step feeds the model one token per run: every linear layer multiplies a handful
of rows by its weight. On the CPU, ``F.linear`` hands that to BLAS as x @ W^T, and MKL's
kernel for a few rows against a transposed weight is slow: on this project's 2-core CPU the
embedded model's forward took 57-74 ms at 5 rows against 44-47 ms at 1 row, though reading the
weights (the real cost) is the same. The same product computed as W @ x^T (weight untouched,
x transposed) brings the 5-row forward to 40-43 ms (``bench/linear_rows.py`` measures both).
That kernel is fast up to ~6 rows and loses its edge beyond (the 30 layers' linears alone at
7 / 8 / 12 rows: 35 / 36 / 39 ms as x @ W^T, 34 / 38 / 49 ms as W @ x^T), so 7..10 rows (the probes'
forked teacher-forcing rows give 8-10) go in two equal chunks (8 rows: 55 vs 60 ms; 10 rows: about
equal), and from there on MKL's own kernel is left alone (16 rows in three chunks: 106 vs 74 ms).
The result is the same matrix product (the dot products' summation order may differ at the last
bit, as between any two BLAS kernels).

``few_row_linears(rows, device)`` is a context manager: a ``TorchFunctionMode`` that reroutes
``F.linear`` while it is active, only on the CPU and only for 2..10 rows. The model's code is not
touched; everything else passes through unchanged. A mode sees every torch call (~15k per lockstep
step, most of them in the compressors' attention), so kvlab's own code inside the forward (the
cache's append, the attention handler) runs under ``torch_functions_plain()``, which switches
``__torch_function__`` handling off for its block.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MAX_ROWS = 10  # rerouted up to this many rows
CHUNK_ROWS = 6  # rows per W @ x^T product


def linear_transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as (weight @ x^T)^T, at most CHUNK_ROWS rows per product.

    x: [..., k]; weight: [n, k] -> [..., n].
    """
    rows = x.reshape(-1, x.shape[-1])
    chunk = math.ceil(len(rows) / math.ceil(len(rows) / CHUNK_ROWS))  # the fewest equal chunks
    parts = [torch.mm(weight, part.t()).t() for part in rows.split(chunk)]  # [c, n] each
    out = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class _FewRowLinears(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            if weight.dim() == 2 and 1 < x.numel() // max(1, x.shape[-1]) <= MAX_ROWS:
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return linear_transposed(x, weight, bias)
        return func(*args, **kwargs)


def torch_functions_plain() -> contextlib.AbstractContextManager:
    """Switch ``__torch_function__`` handling (modes and subclasses) off inside this block."""
    return torch._C.DisableTorchFunction()


def few_row_linears(rows: int, device: torch.device | str) -> contextlib.AbstractContextManager:
    """Reroute ``F.linear`` for 2..MAX_ROWS rows on the CPU while active; a no-op elsewhere."""
    if torch.device(device).type != "cpu" or not 1 < rows <= MAX_ROWS:
        return contextlib.nullcontext()
    return _FewRowLinears()
