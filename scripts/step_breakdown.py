"""Where a decode step goes: time per engine step spent in each compiled call (the fused GDN and
attention layers, the norms, the bf16 GEMV / GEMM, the int8 and int4 products, the LM head), for B
sequences decoding side by side.

    python scripts/step_breakdown.py /tmp/r08b --batch 32 --threads 2
    python scripts/step_breakdown.py /tmp/r08b --batch 1 --quantization int8

Each call is wrapped with a timer (a microsecond or two per call); the rest of a step is Python,
sampling and scheduling. The LM head's row counts its product again (half_gemm, gemv_bf16 or the
int8 or int4 products include it). Give the cache room for all B requests (--cache-memory): the
script stops if fewer than B run at once.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

from hybridrt import LLM, SamplingParams
from hybridrt.kernels import int4, native, quant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--cache-memory", default="0.2")
    args = ap.parse_args()
    mem = float(args.cache_memory) if "." in args.cache_memory else args.cache_memory
    llm = LLM(args.model, dtype="bfloat16", quantization=args.quantization,
              max_num_seqs=args.batch, max_model_len=512, cache_memory=mem,
              threads=args.threads)
    eng = llm.engine
    total: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def timed(owner, name, label):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            total[label] += time.perf_counter() - t
            calls[label] += 1
            return out
        setattr(owner, name, wrapper)

    for name in ("gdn_fused", "attn_decode", "rms_norm", "gemv_bf16", "half_gemm"):
        timed(native, name, name)
    timed(quant, "linear", "int8 products")
    timed(int4, "linear", "int4 products")
    timed(eng.runner.model.backend, "logits", "LM head (logits)")
    sp = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(list(range(10 + i, 26 + i)), sp)
    for _ in range(4):  # the prompts' prefill, then a few decode steps
        eng.step()
    if len(eng.scheduler.running) < args.batch:
        raise SystemExit(f"only {len(eng.scheduler.running)} of {args.batch} requests fit the "
                         f"cache: raise --cache-memory")
    total.clear()
    calls.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    step = (time.perf_counter() - t0) / args.steps
    print(f"load average {os.getloadavg()[0]:.2f}; batch {args.batch}, "
          f"{args.quantization or 'bf16'} weights, {args.threads} threads: step "
          f"{step * 1e3:.2f} ms, {args.batch / step:.1f} tok/s")
    print(f"{'call':18s} {'ms/step':>8s} {'calls/step':>11s}")
    for label, t in total.most_common():
        print(f"{label:18s} {t / args.steps * 1e3:8.2f} {calls[label] / args.steps:11.1f}")


if __name__ == "__main__":
    main()
