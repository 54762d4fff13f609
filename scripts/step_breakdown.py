"""Where a decode step goes: time per engine step spent in each compiled call (the fused GDN and
attention layers, the norms, the bf16 GEMV / GEMM, the int8 and int4 products, the LM head), for B
sequences decoding side by side; several batch sizes and weight kinds in one run, their rounds
alternated, so that their ratios come from the same minutes of the machine.

    python scripts/step_breakdown.py /tmp/r08b --batch 1,2,4,8 --quantization none,int8
    python scripts/step_breakdown.py /tmp/r08b --batch 32 --threads 2
    python scripts/step_breakdown.py /tmp/r08b --batch 1,2,4,8 --threads 1 --cpu-time

Each call is wrapped with a timer (a microsecond or two per call); the rest of a step is Python,
sampling and scheduling. Where a step's layers run as one compiled call (kernels/step.py) that
call is one row, "layers (one call)"; ``--no-program`` calls them one by one, each kernel its
own row. The LM head's row counts its product again (half_gemm, gemv_bf16 or the
int8 or int4 products include it). Per (weights, batch) the figures are medians over the rounds;
"x b1" is the tokens per second over batch 1's of the same weights. ``--cpu-time``: every time in
this process's CPU seconds (with one thread, the step on a core of its own, the other processes of a
busy machine then counting only through the memory bandwidth they take). Give the cache room
for all B requests (--cache-memory): the script stops if fewer than B run at once.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

from hybridrt import LLM, SamplingParams
from hybridrt.kernels import int4, native, quant
from hybridrt.kernels.step import StepProgram

CALLS = ("gdn_fused", "attn_decode", "rms_norm", "gemv_bf16", "half_gemm", "gemv_rows", "gemm_lanes")
clock = time.perf_counter


def _timers(llm, total: collections.Counter, calls: collections.Counter) -> None:
    """Wrap the compiled calls and this engine's LM head with timers adding into total/calls
    (the kernels' modules once for every LLM; their wrappers stay)."""
    def timed(owner, name, label):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t = clock()
            out = fn(*a, **k)
            total[label] += clock() - t
            calls[label] += 1
            return out
        wrapper.timed = True
        setattr(owner, name, wrapper)

    if not getattr(native.gdn_fused, "timed", False):
        for name in CALLS:
            timed(native, name, name)
        timed(quant, "linear", "int8 products")
        timed(int4, "linear", "int4 products")
        timed(StepProgram, "run", "layers (one call)")
    timed(llm.engine.runner.model.backend, "logits", "LM head (logits)")


def _measure(llm, batch: int, steps: int, total, calls) -> tuple[float, dict, dict]:
    """``steps`` decode steps of ``batch`` sequences -> (seconds a step, ms a step per call,
    calls a step)."""
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        eng.add_request(list(range(10 + i, 26 + i)), sp)
    for _ in range(4):  # the prompts' prefill, then a few decode steps
        eng.step()
    if len(eng.scheduler.running) < batch:
        raise SystemExit(f"only {len(eng.scheduler.running)} of {batch} requests fit the "
                         f"cache: raise --cache-memory")
    total.clear()
    calls.clear()
    t0 = clock()
    for _ in range(steps):
        eng.step()
    step = (clock() - t0) / steps
    ms = {k: v / steps * 1e3 for k, v in total.items()}
    per = {k: v / steps for k, v in calls.items()}
    while eng.has_unfinished_requests():  # the last tokens; their requests leave
        eng.step()
    return step, ms, per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds of every row")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="none", help="comma-separated: none, int8, int4")
    ap.add_argument("--cache-memory", default="0.2")
    ap.add_argument("--cpu-time", action="store_true", help="time in this process's CPU seconds")
    ap.add_argument("--no-program", action="store_true",
                    help="the decode layers called one by one (HYBRIDRT_STEP_PROGRAM=0): each "
                         "kernel's time shows")
    args = ap.parse_args()
    if args.no_program:
        os.environ["HYBRIDRT_STEP_PROGRAM"] = "0"
    global clock
    clock = time.process_time if args.cpu_time else time.perf_counter
    batches = [int(b) for b in args.batch.split(",")]
    kinds = [None if q in ("none", "bf16") else q for q in args.quantization.split(",")]
    mem = float(args.cache_memory) if "." in args.cache_memory else args.cache_memory
    total: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    llms = {}
    for q in kinds:
        llms[q] = LLM(args.model, dtype="bfloat16", quantization=q, max_num_seqs=max(batches),
                      max_model_len=512, cache_memory=mem, threads=args.threads)
        _timers(llms[q], total, calls)
    load = [os.getloadavg()[0]]
    runs: dict[tuple, list] = collections.defaultdict(list)
    for q in kinds:  # warm-up: every shape once
        for b in batches:
            _measure(llms[q], b, 2, total, calls)
    for _ in range(args.rounds):
        for q in kinds:
            for b in batches:
                runs[q, b].append(_measure(llms[q], b, args.steps, total, calls))
    load.append(os.getloadavg()[0])
    print(f"load average {load[0]:.2f} -> {load[1]:.2f}; {args.threads} threads; "
          f"{args.steps} steps x {args.rounds} alternated rounds, medians"
          + ("; CPU TIME" if args.cpu_time else ""))
    for q in kinds:
        name = q or "bf16"
        step = {b: statistics.median(r[0] for r in runs[q, b]) for b in batches}
        first = runs[q, batches[0]]
        labels = sorted({k for b in batches for r in runs[q, b] for k in r[1]},
                        key=lambda k: -statistics.median(r[1].get(k, 0) for r in first))
        print(f"\n{name} weights       " + "".join(f"{'batch ' + str(b):>12}" for b in batches))
        print(f"{'step ms':<20}" + "".join(f"{step[b] * 1e3:>12.2f}" for b in batches))
        print(f"{'tok/s':<20}" + "".join(f"{b / step[b]:>12.1f}" for b in batches))
        if batches[0] == 1:
            print(f"{'x b1 tok/s':<20}" + "".join(f"{b / step[b] * step[1]:>12.2f}"
                                                   for b in batches))
        for k in labels:
            ms = {b: statistics.median(r[1].get(k, 0.0) for r in runs[q, b]) for b in batches}
            n = statistics.median(r[2].get(k, 0.0) for r in runs[q, batches[-1]])
            print(f"{k:<20}" + "".join(f"{ms[b]:>12.2f}" for b in batches)
                  + f"   ms/step ({n:.0f} calls)")


if __name__ == "__main__":
    main()
