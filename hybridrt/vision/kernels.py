"""What the vision tower computes its products and attention with: ``VisionKernels``.

- Products (qkv, proj, the MLP's fc1 / fc2, the merger's fc1 / fc2) go to a kernel backend's
  ``linear`` (``hybridrt.kernels.backend``, the text model's): int8 / 4-bit weights
  (``quantize_tower``) on the CPU backend's compiled int8 / 4-bit GEMMs, half weights on its
  bf16 GEMM (``kernels/linear.py``), the bias added to the product's result. One exception,
  by measurement: half weights on a CPU with bf16 matrix instructions (AMX / AVX512-BF16,
  ``prefill_attention.fast_bf16``) go to ``F.linear`` (oneDNN, the bias fused), which ran the
  tower's shapes (784 and 3,072 rows of 768 / 3,072 inputs) about 8x faster than the
  backend's bf16dot path per core (docs/vision.md); the batch-invariant mode keeps the
  backend's products there too. Without a backend (``VisionKernels()``, an encoder built
  alone) every product is ``F.linear``.
- Attention runs within each image (or frame) only. With a backend, on CPU tensors, it uses
  torch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, as
  ``kernels/prefill_attention.py`` does): blocked with an online softmax, never the [heads, n,
  n] scores, computed in bf16 for bf16 activations on a CPU with AMX / AVX512-BF16, in fp32
  otherwise. Elsewhere, and without a backend, ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridrt.kernels import int4, prefill_attention, quant


class VisionKernels:
    """The tower's products and per-image attention: on ``backend`` (a kernel backend, e.g.
    the engine's ``CPUBackend``), or with plain torch ops when it is None."""

    def __init__(self, backend=None):
        self.backend = backend
        self.flash = backend is not None and prefill_attention.available()
        self.bf16_fast = backend is not None and prefill_attention.fast_bf16()
        # half products on oneDNN's bf16 GEMM, not the backend's (see the module's docstring)
        self.onednn_half = self.bf16_fast and not getattr(backend, "invariant", False)

    def linear(self, x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
        """x W^T + b for ``module``'s weight (``weight``, or ``qweight`` once quantized)."""
        w = quant.kernel_weight(module)
        packed = isinstance(w, quant.PackedWeight)
        if self.backend is None or (self.onednn_half and not packed and x.device.type == "cpu"
                                    and w.dtype in (torch.bfloat16, torch.float16)):
            return F.linear(x, w.dequantize(x.dtype) if packed else w, module.bias)
        y = self.backend.linear(x.contiguous(), w)
        return y if module.bias is None else y.add_(module.bias)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  bounds: Sequence[int]) -> torch.Tensor:
        """q, k, v [n, heads, head_dim] -> [n, heads, head_dim]: rows ``bounds[i]`` ..
        ``bounds[i + 1] - 1`` attend to each other only (no mask within a segment)."""
        out = torch.empty_like(q)
        flash = self.flash and q.device.type == "cpu"
        dtype = prefill_attention.compute_dtype(q.dtype, self.bf16_fast)
        for s, e in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))  # [1, H, len, D]
            if flash:
                o = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    qs.to(dtype), ks.to(dtype), vs.to(dtype), 0.0, False)[0]
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs)
            out[s:e] = o[0].transpose(0, 1)
        return out


def quantize_tower(encoder: nn.Module, quantization: str) -> None:
    """The tower's linear products (every ``nn.Linear``: the blocks' qkv, proj, fc1, fc2 and
    the merger's fc1, fc2) in ``quantization`` ("int8": ``quant.quantize``, "int4":
    ``int4.quantize``), in place: ``weight`` becomes None and ``qweight`` the quantized weight;
    biases, norms, the patch embedding and the position grid stay in the model's dtype."""
    if quantization not in ("int8", "int4"):
        raise ValueError(f"quantize_tower: unknown quantization {quantization!r}")
    for m in encoder.modules():
        if isinstance(m, nn.Linear) and m.weight is not None:
            w = m.weight.detach()
            m.qweight = quant.quantize(w) if quantization == "int8" else int4.quantize(w)
            m.weight = None
