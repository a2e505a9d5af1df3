"""kvlab: a lab bench for KV-cache compression on a real language model."""

__version__ = "0.1.0"
