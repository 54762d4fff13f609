"""Numeric ops for hybridrt: plain-torch references (the CPU path).

Every public op takes packed ``[T, ...]`` inputs (several sequences described by
``cu_seqlens``) and, where it carries state, reads and writes per-sequence state slots of a
pool tensor. These plain-torch versions are the reference and the CPU path; GPU fast paths
(fla / Triton / causal-conv1d, the ``gpu`` extra) must sit behind the same functions and be
imported lazily, so that this package imports with no GPU libraries installed.
"""

from .attention import paged_attention, varlen_causal_attention, write_kv
from .conv import causal_conv1d_update, causal_conv1d_varlen
from .delta_rule import chunk_gated_delta_rule, naive_gated_delta_rule, recurrent_gated_delta_rule
from .linear import linear, linear_fp32, pack_weight, use_fp32_gemm
from .norm import gated_rms_norm, l2_norm, rms_norm
from .rope import apply_partial_rope, rope_cos_sin

__all__ = [
    "apply_partial_rope",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "chunk_gated_delta_rule",
    "gated_rms_norm",
    "l2_norm",
    "linear",
    "use_fp32_gemm",
    "linear_fp32",
    "pack_weight",
    "naive_gated_delta_rule",
    "paged_attention",
    "recurrent_gated_delta_rule",
    "rms_norm",
    "rope_cos_sin",
    "varlen_causal_attention",
    "write_kv",
]
