"""Numeric ops for hybridrt: plain-torch references (the CPU path).

Every public op takes packed ``[T, ...]`` inputs (several sequences described by
``cu_seqlens``) and, where it carries state, reads and writes per-sequence state slots of a
pool tensor. These plain-torch versions are the reference and the CPU path; GPU fast paths
(fla / Triton / causal-conv1d, the ``gpu`` extra) must sit behind the same functions and be
imported lazily, so that this package imports with no GPU libraries installed.
"""

if __name__ == "kernels":
    # This folder imported as a top-level ``kernels``: the clone's root is first on sys.path
    # (``python -m pytest`` or ``python -c`` run there). It is ``hybridrt.kernels``; the name
    # ``kernels`` belongs to Hugging Face's kernels distribution, which transformers imports
    # (>= 5.25). Hand the import over to that package (the import statement returns what
    # sys.modules holds when this file ends), or fail naming this folder; never run the ops
    # below as ``kernels``.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        __name__, [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is None or _spec.loader is None:
        raise ImportError(f"{os.path.dirname(__file__)} is hybridrt.kernels, not the package "
                          "'kernels' (not installed): import it as hybridrt.kernels",
                          name=__name__)
    _real = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _real
    try:
        _spec.loader.exec_module(_real)
    except BaseException:
        del sys.modules[__name__]
        raise
else:
    from .attention import paged_attention, varlen_causal_attention, write_kv
    from .conv import causal_conv1d_update, causal_conv1d_varlen
    from .delta_rule import (
        chunk_gated_delta_rule,
        naive_gated_delta_rule,
        recurrent_gated_delta_rule,
    )
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
