"""A quantized GGUF tensor into hybridrt's format in one pass of compiled code
(kernels/csrc/gguf_repack.c) over the file's mapped bytes: Q8_0 -> int8, Q4_0 / Q4_1 / Q4_K ->
int4, Q6_K -> int6, the same bytes as the torch path of ``blocks`` and ``tensors`` (tested
against each other). ``packed`` answers None where that path is to be taken instead: no
compiled kernels (``HYBRIDRT_NATIVE=0``, no compiler), another type, columns that do not move
in whole groups of 32, a group with a negative minimum (the torch path quantizes that tensor
again) or a Q8_0 value of -128 (the torch path refuses it, in one line).
"""

from __future__ import annotations

import ctypes

import torch

from hybridrt.gguf import names
from hybridrt.kernels import int4, native, quant

TYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q4_K": 12, "Q6_K": 14}  # GGML ids
_typed = False


def _lib():
    global _typed
    lib = native.load()
    if lib is not None and not _typed:
        P, I64 = ctypes.c_void_p, ctypes.c_int64
        lib.gguf_repack.restype = ctypes.c_int
        lib.gguf_repack.argtypes = [P, I64, ctypes.c_int, I64, I64, P, P, P, P, P, P,
                                    ctypes.c_int]
        _typed = True
    return lib


def _index(order: torch.Tensor | None) -> torch.Tensor | None:
    return None if order is None else order.to(torch.int64).contiguous()


def packed(t, shape: tuple[int, int], src: names.Source) -> quant.PackedWeight | None:
    """GGUF tensor ``t`` (our shape [N, K]) with ``src``'s rows and column groups put back in
    order, in its hybridrt format; None where the torch path is to be taken."""
    kind = t.tensor_type.name
    if kind not in TYPES:
        return None
    lib = _lib()
    if lib is None:
        return None
    N, K = shape
    rows, groups = _index(src.rows), None
    if src.cols is not None:
        first = src.cols.view(-1, quant.GROUP)[:, :1]
        if (src.cols.view(-1, quant.GROUP) - first != torch.arange(quant.GROUP)).any() or (
                first % quant.GROUP).any():
            return None
        groups = _index(first[:, 0] // quant.GROUP)
    data = t.data.reshape(N, -1)
    if kind == "Q8_0":
        qs_shape, scales_shape = quant.packed_shapes((N, K))
        out = [torch.empty(qs_shape, dtype=torch.int8), None, None,
               torch.empty(scales_shape, dtype=torch.float16)]
    else:
        bits = 6 if kind == "Q6_K" else 4
        shapes = int4.packed_shapes((N, K), bits)
        out = [torch.empty(shapes[0], dtype=torch.uint8),
               torch.empty(shapes[1], dtype=torch.uint8) if bits == 6 else None,
               torch.empty(shapes[-2], dtype=torch.uint8),
               torch.empty(shapes[-1], dtype=torch.bfloat16)]
    ptrs = [None if x is None else x.data_ptr() for x in out]
    rc = lib.gguf_repack(data.ctypes.data, data.strides[0], TYPES[kind], N, K,
                         None if rows is None else rows.data_ptr(),
                         None if groups is None else groups.data_ptr(), *ptrs,
                         torch.get_num_threads())
    if rc:
        return None
    qs, hs, codes, scales = out
    if kind == "Q8_0":
        return quant.QuantWeight(qs, scales, (N, K))
    if hs is not None:
        return int4.Int6Weight(qs, hs, codes, scales, (N, K))
    return int4.Int4Weight(qs, codes, scales, (N, K))
