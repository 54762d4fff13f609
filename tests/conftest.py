import os

# Under the Triton interpreter a tl.dot is numpy's matmul, and OpenBLAS's FMA kernels (Haswell,
# Zen: every AVX2-only x86 CPU) give a row of the product other bits at some positions in its
# block of rows (the check in docs/testing.md), which the batch-invariance tests read as a
# kernel whose rows depend on their neighbours. Its Sandybridge kernels give each row the
# same bits at any position. Set before numpy loads OpenBLAS.
if os.environ.get("TRITON_INTERPRET") == "1":
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

import pytest  # noqa: E402
import torch  # noqa: E402

# One thread: the tiny test models gain nothing from two, and on a loaded 2-core machine every
# multi-threaded op can wait a whole scheduler slice for its second thread.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread_module():
    """One thread for a module's tests, whatever a test before it left (the benchmarks' and
    the CLI's tests set their own): the tiny models' ops are far too small to gain from
    intra-op threads, and on a busy 2-core machine OpenMP spin-waits make 2 threads several
    times slower than 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
