"""Quantization helpers: bit packing and asymmetric group quantization (see ``kernels.quant``).

The storage formats live beside the kernels that read them; this module re-exports them.
"""

from kernels.quant import (
    SUPPORTED_BITS,
    QuantizedGroups,
    cat_groups,
    code_table,
    dequantize_groups,
    group_error_bound,
    pack_codes,
    pack_signs,
    packed_bytes,
    quantize_groups,
    sign_table,
    storage_bits,
    unpack_codes,
    unpack_signs,
    weighted_token_sum,
)

__all__ = [
    "SUPPORTED_BITS",
    "QuantizedGroups",
    "cat_groups",
    "code_table",
    "dequantize_groups",
    "group_error_bound",
    "pack_codes",
    "pack_signs",
    "packed_bytes",
    "quantize_groups",
    "sign_table",
    "storage_bits",
    "unpack_codes",
    "unpack_signs",
    "weighted_token_sum",
]
