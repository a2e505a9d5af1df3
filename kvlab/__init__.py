"""kvlab: a lab bench for KV-cache compression on a real language model."""

from kvlab.core.threads import configure_openmp

configure_openmp()  # before torch loads its OpenMP runtime: idle threads sleep instead of spinning

__version__ = "0.1.0"
