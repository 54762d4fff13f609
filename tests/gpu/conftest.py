"""Triton kernel tests: on a GPU when there is one, else on CPU under TRITON_INTERPRET=1.

These run in their own virtualenv (triton + fla-core installed; see .ci/run): in the main test
environment triton is absent and the whole folder is skipped.
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU: run with TRITON_INTERPRET=1", allow_module_level=True)

import fla_interpret  # noqa: E402,F401  (lets fla's kernels run under the interpreter)

torch.set_num_threads(1)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")
