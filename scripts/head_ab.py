"""The LM head's product in its two formats side by side (docs/performance.md, "## int4"): the
tied embedding / LM head [vocab, hidden] (0.8B shape: 248320 x 1024) in int8 (what
``quantization="int4"`` kept before) and in 6 bits (what it keeps now), each called as the decode
loop calls it (``quant.linear`` / ``int4.linear`` on bf16 x), random bytes (the kernels' time does
not depend on them), rounds alternating formats and row counts; medians of process CPU ms.

    python scripts/head_ab.py [ROWS] [ISA4] [ISA8]   # e.g. 1,4 vnni vnni (one thread)
"""

import statistics
import sys
import time

import torch

from hybridrt.bench.fixtures import QWEN35_08B_TEXT_CONFIG as cfg
from hybridrt.bench.gemv import _random_int4
from hybridrt.kernels import int4, quant

torch.set_num_threads(1)
rows = [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "1,4").split(",")]
isa4 = sys.argv[2] if len(sys.argv) > 2 else int4.select_isa()
isa8 = sys.argv[3] if len(sys.argv) > 3 else quant.select_isa()
reps = 9
N, K = cfg["vocab_size"], cfg["hidden_size"]
g = torch.Generator().manual_seed(0)
qs_shape, sc_shape = quant.packed_shapes((N, K))
heads = {
    "int8": (quant.QuantWeight(torch.randint(-127, 128, qs_shape, generator=g, dtype=torch.int8),
                               (torch.rand(sc_shape, generator=g) * 1e-3).half(), (N, K)),
             lambda x, w: quant.linear(x, w, isa8)),
    "6-bit": (_random_int4(N, K, g, 6), lambda x, w: int4.linear(x, w, isa4)),
}
xs = {m: torch.randn(m, K, generator=g).bfloat16() for m in rows}
for w, f in heads.values():  # warm-up (the outputs' pages)
    for m in rows:
        f(xs[m], w)
times = {(h, m): [] for h in heads for m in rows}
for _ in range(reps):
    for m in rows:
        for h, (w, f) in heads.items():
            t0 = time.process_time()
            f(xs[m], w)
            times[h, m].append(time.process_time() - t0)
print(f"LM head {N} x {K}, one thread, int8 path {isa8}, 6-bit path {isa4}; "
      f"MB: int8 {heads['int8'][0].nbytes / 1e6:.0f}, 6-bit {heads['6-bit'][0].nbytes / 1e6:.0f}")
for m in rows:
    a, b = (statistics.median(times[h, m]) for h in heads)
    print(f"M={m}: int8 {1e3 * a:.1f} ms, 6-bit {1e3 * b:.1f} ms, 6-bit / int8 {b / a:.3f}")
