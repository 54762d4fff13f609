import os
import sys

import torch
from torch.utils._triton import has_triton_package

# One thread: the tiny test models gain nothing from two, and on a loaded 2-core machine every
# multi-threaded op can wait a whole scheduler slice for its second thread.
torch.set_num_threads(1)

# pytest puts tests/ on sys.path (for ``from helpers import ...``), where the folder
# tests/triton would be found as a namespace package named ``triton``: torch would then take
# Triton for installed and fail on ``triton.language``. torch caches its answer: ask it once
# without tests/ on the path.
_here = os.path.dirname(os.path.abspath(__file__))
_path = list(sys.path)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
try:
    has_triton_package()
finally:
    sys.path[:] = _path
