"""One decode step's 1-row products (0.8B shape), bf16dot and int8 vnni, ms per step (median
of 15, process CPU time): run it from an old and a new tree's virtualenv in turn to compare
their kernels in separate processes (docs/performance.md, "Few-row products").

    python scripts/gemv_onerow.py [THREADS]
"""

import statistics
import sys
import time

import torch

from hybridrt.bench.fixtures import QWEN35_08B_TEXT_CONFIG as cfg
from hybridrt.kernels import native, quant

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)

# same shapes as bench gemv's step_products, copied here so the old tree can run it
h, inter = cfg["hidden_size"], cfg["intermediate_size"]
hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
gdn = [(2 * hk * dk + hv * dv + hv * dv + 2 * hv, h), (h, hv * dv)]
attn = [(2 * heads * d + 2 * kv * d, h), (h, heads * d)]
mlp = [(2 * inter, h), (h, inter)]
shapes = []
for i in range(cfg["num_hidden_layers"]):
    shapes += (attn if (i + 1) % 4 == 0 else gdn) + mlp
shapes.append((cfg["vocab_size"], h))
g = torch.Generator().manual_seed(0)
ws = [(torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16) for n, k in shapes]
qws = [quant.quantize(w.float()) for w in ws]
xs = {k: torch.randn(1, k, generator=g).to(torch.bfloat16) for _, k in shapes}
isa = "vnni" if "vnni" in quant.available_isas() else quant.select_isa()


def t(f, reps=15):
    f()
    out = []
    for _ in range(reps):
        t0 = time.process_time()
        f()
        out.append(time.process_time() - t0)
    return 1e3 * statistics.median(out)


bf = t(lambda: [native.gemv_bf16(xs[w.shape[1]], w, "bf16dot") for w in ws])
i8 = t(lambda: [quant.linear(xs[q.shape[1]], q, isa) for q in qws])
print(f"bf16dot {bf:.1f} ms  int8-{isa} {i8:.1f} ms")
