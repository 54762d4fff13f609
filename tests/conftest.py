import pytest
import torch

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
