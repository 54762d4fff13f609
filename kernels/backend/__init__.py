"""Kernel backends: the one place that decides which kernel runs.

A backend is chosen once, when the engine starts (``select_backend``), and bound to the model
(``Qwen35ForCausalLM.set_backend``). Each step the model asks it to plan the batch (``plan_step``):
every piece of per-step metadata (decode rows, prefill chunk groups, slot indices, per-position
verify slots, block tables, sequence lengths) is built there, once, from the host-side lists
the runner already has. The layers then call the backend with that metadata and only index
into it: no layer converts a tensor to Python or decides on a kernel.

Every backend implements ``Backend`` (``base.py``) and reads the model only as records
(``layers.py``): each mixer's record per call, the whole decoder's (``ModelRecord``) once at
``bind``. The model embeds the tokens and asks for the RoPE rows itself and hands them over.

- ``ReferenceBackend``: plain torch everywhere, the definition of correct.
- ``CPUBackend``: the compiled GDN decode step and half-precision GEMV/GEMM on the weights as
  the model holds them, int8 GEMV/GEMM on quantized ones (``kernels/csrc``) where they built
  for this CPU; plain torch (and an fp32 copy of each half weight for batched products)
  otherwise (it holds a ``ReferenceBackend`` for those steps: composed, not inherited).
- ``CudaBackend`` (``kernels/cuda/backend.py``): Triton kernels for decode and verification
  (GDN over the slot pool, paged attention, fused norms), fla and SDPA for prompt chunks,
  merged projections through cuBLAS, CUDA graphs.

Files:

- ``base.py``: the ``Backend`` protocol;
- ``plan.py``: the step metadata and GDN routing every backend builds per step;
- ``layers.py``: what a backend reads of the model (tensors and sizes, no modules);
- ``reference.py``: ``ReferenceBackend``, ``plan`` and ``run_gdn``;
- ``cpu.py``: ``CPUBackend`` and its fused-layer decode loop;
- ``select.py``: ``select_backend``; ``kernels/cuda/backend.py``: ``CudaBackend``, imported by
  ``select_backend`` only (it imports ``plan`` and ``reference``, never this package's
  ``select``).
"""

from .base import Backend
from .cpu import CPUBackend
from .layers import AttentionLayer, DecoderLayerRecord, GDNLayer, ModelRecord
from .plan import ChunkedSeqs, GDNMeta, RecurrentGroup, StepMeta, gdn_split
from .reference import ReferenceBackend
from .select import select_backend

__all__ = [
    "AttentionLayer",
    "Backend",
    "CPUBackend",
    "ChunkedSeqs",
    "DecoderLayerRecord",
    "GDNLayer",
    "GDNMeta",
    "ModelRecord",
    "RecurrentGroup",
    "ReferenceBackend",
    "StepMeta",
    "gdn_split",
    "select_backend",
]
