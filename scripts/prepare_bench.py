"""Time to build one step's batch and backend metadata (``build_batch`` + ``CPUBackend.prepare``)
on the tiny test config, for a few step shapes: minimum over 7 rounds of 200.

    python scripts/prepare_bench.py

Works on commits before the step buffers (kernels/meta.py) too, for before/after comparisons.
"""

import inspect
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import build_model  # noqa: E402

from hybridrt.bench.fixtures import tiny_text_config  # noqa: E402
from hybridrt.kernels.backend import CPUBackend  # noqa: E402
from hybridrt.runner import build_batch  # noqa: E402

_, config, _ = build_model(tiny_text_config(), seed=0, dtype=torch.float32)
backend = CPUBackend(config)
bufs = None
if "arrays" in inspect.signature(build_batch).parameters:
    from hybridrt.kernels.meta import StepBuffers

    bufs = StepBuffers.for_limits(64, 2048, 256, config.linear_conv_kernel_dim)
cases = {
    "decode, batch 1": ([[5]], [100]),
    "decode, batch 32": ([[5]] * 32, [100 + i for i in range(32)]),
    "prefill, one 512-token prompt": ([[3] * 512], [0]),
    "8 decodes + a 256-token chunk": ([[5]] * 8 + [[3] * 256], [100] * 8 + [0]),
}
for name, (tokens, starts) in cases.items():
    tables = [list(range(48))] * len(tokens)
    rounds = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(200):
            kw = {}
            if bufs is not None:
                bufs.begin()
                kw["arrays"] = bufs
            batch = build_batch(tokens, starts, tables, 16, list(range(len(tokens))), **kw)
            batch.meta = backend.plan_step(batch)
        rounds.append((time.perf_counter() - t0) / 200 * 1e6)
    print(f"{name}: {min(rounds):.1f} us")
