"""fp32 products in fla's chunked kernels, without leaving a trace in the environment.

fla's chunked kernels call ``tl.dot`` at Triton's default input precision, tf32 for fp32
operands on a GPU. Triton reads that default from ``TRITON_F32_DEFAULT`` when it compiles a
kernel (and keys its caches on it); fla gives no argument for it. So ``fp32_products`` sets
the variable for the call only, and leaves the environment exactly as it found it: absent
stays absent, a value the user set is used and kept. Imports neither Triton nor fla (tested
without them).
"""

from __future__ import annotations

import contextlib
import os

import torch

KEY = "TRITON_F32_DEFAULT"


@contextlib.contextmanager
def fp32_products(dtype: torch.dtype):
    """Within: ``tl.dot`` on fp32 operands at the default precision multiplies in fp32 (not
    tf32) when ``dtype`` is fp32; nothing changes otherwise or when the user set
    ``TRITON_F32_DEFAULT`` themselves."""
    if dtype != torch.float32 or KEY in os.environ:
        yield
        return
    os.environ[KEY] = "ieee"
    try:
        yield
    finally:
        if os.environ.get(KEY) == "ieee":  # what we set: gone again
            del os.environ[KEY]
