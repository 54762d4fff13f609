"""``select_backend``: the one place that picks a backend for a device (the CUDA one imported
only when asked for)."""

from __future__ import annotations

import torch

from ..options import KernelOptions
from .cpu import CPUBackend
from .reference import ReferenceBackend


def select_backend(config, device: torch.device | str = "cpu", name: str | None = None,
                   options: KernelOptions | None = None):
    """The backend for ``device``: "cpu" -> CPUBackend, "cuda" -> CudaBackend; ``name``
    forces one ("reference", "cpu", "cuda", or "triton": the CUDA backend's kernels without
    CUDA graphs, which also runs on CPU tensors under ``TRITON_INTERPRET=1``). ``options``:
    the kernels' switches (``hybridrt.env.kernel_options()``; defaults when None)."""
    device = torch.device(device)
    if name is None:
        name = "cuda" if device.type == "cuda" else "cpu"
    if name == "reference":
        return ReferenceBackend(config, device, options)
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the cpu backend runs on the CPU, not {device}")
        return CPUBackend(config, device, options)
    if name in ("cuda", "triton"):
        from ..cuda.backend import CudaBackend

        return CudaBackend(config, device, graphs=name == "cuda", options=options)
    raise ValueError(f"unknown backend {name!r}: use reference, cpu, cuda or triton")

