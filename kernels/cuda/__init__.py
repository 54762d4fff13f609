"""Triton (and fla) kernels for the CUDA backend.

Nothing here is imported on the CPU path: ``hybridrt.kernels.backend`` imports these modules
only when a CUDA (or, in tests, a Triton-interpreter) backend is built. Every kernel is tested
against the plain-torch reference in ``hybridrt.kernels`` by ``tests/gpu`` (on CPU under
``TRITON_INTERPRET=1``, in a separate virtualenv; on a GPU for real).
"""
