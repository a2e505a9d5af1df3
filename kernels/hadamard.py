"""The orthonormal Walsh-Hadamard rotation the serving engines apply to a KV cache before quantizing it.

H_n (n a power of two) is Sylvester's matrix scaled by 1/sqrt(n): H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]
/ sqrt(2), so entry (i, j) is (-1)^popcount(i & j) / sqrt(n). It is symmetric and orthonormal (H H = I): the
same matrix rotates and rotates back, and it leaves inner products unchanged. vLLM's TurboQuant presets
rotate a whole head with it; llama.cpp rotates each block of ``nrot`` numbers of a head (keys: the largest
power of two >= 64 dividing head_dim; values: blocks of 64).

* ``hadamard(n)``: the matrix, float32 [n, n].
* ``fwht(x)``: x H along the last dim (a power of two) by the fast transform, O(n log n) per row; equal to
  ``x @ hadamard(n)`` up to float rounding.
* ``block_rotate(x, nrot)``: each block of ``nrot`` consecutive numbers of the last dim rotated by H_nrot.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(n: int) -> Tensor:
    if not is_power_of_two(n):
        raise ValueError(f"a Hadamard rotation needs a power of two, not {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def hadamard(n: int, device: torch.device | str = "cpu") -> Tensor:
    """Sylvester's Hadamard matrix of order ``n`` (a power of two) scaled to be orthonormal, float32 [n, n]."""
    return _hadamard_cpu(n).to(device)


def fwht(x: Tensor) -> Tensor:
    """x H_n along the last dim (n = x.shape[-1], a power of two), float32, by log2(n) butterfly stages."""
    n = x.shape[-1]
    if not is_power_of_two(n):
        raise ValueError(f"a Hadamard rotation needs a power of two, not {n}")
    y = x.float()
    lead = y.shape[:-1]
    h = 1
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], -2)
        h *= 2
    return y.reshape(*lead, n) / math.sqrt(n)


def block_rotate(x: Tensor, nrot: int) -> Tensor:
    """Each block of ``nrot`` consecutive numbers of x's last dim (a multiple of ``nrot``) rotated by H_nrot."""
    d = x.shape[-1]
    if d % nrot:
        raise ValueError(f"blocks of {nrot} do not divide a last dim of {d}")
    lead = x.shape[:-1]
    return fwht(x.reshape(*lead, d // nrot, nrot)).reshape(*lead, d)


__all__ = ["block_rotate", "fwht", "hadamard", "is_power_of_two"]
