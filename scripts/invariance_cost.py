"""What batch-invariant mode costs: ``hybridrt bench throughput``'s hybridrt measurements (prefill,
decode at batch 1 and at each concurrency) with the mode off and on, on one engine per weight
kind whose CPU backend is switched between the modes from round to round (the same weights,
pages and caches for both; greedy requests, so the sampler's positional draws play no part),
the rounds in the order off, on, on, off, ... so that a drift in a shared machine's speed
reaches both; per weight kind the medians over the rounds and on / off.

    python scripts/invariance_cost.py /tmp/r08b --threads 2 --quantization none,int8

``--cpu-time``: the same work timed in this process's CPU seconds instead (prefill: one
token from the prompt; decode at batch B: B requests of ``--decode-tokens`` new tokens less the
same requests' first token), which a busy machine's other processes reach only through the
memory bandwidth they take; meant for ``--threads 1``.

Run it under ``flock /work/.bench.lock`` on a shared machine (docs/batch_invariance.md has the
figures and the load average they were taken at).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch

from hybridrt.bench.throughput import _prompts, bench_ours, load_ours
from hybridrt.sampling_params import SamplingParams


def bench_cpu(llm, prefill_len: int, decode_tokens: int, concurrency: list[int],
              prompt_len: int, repeats: int) -> dict:
    """bench_ours' rows in tokens per CPU second of this process (medians of ``repeats``)."""
    vocab, clock = llm.config.vocab_size, time.process_time

    def cpu(prompts, n):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = clock()
        llm.generate(prompts, sp, use_tqdm=False)
        return clock() - t

    res = {"prefill_tok_s": prefill_len / statistics.median(
        cpu(_prompts(1, prefill_len, vocab, 100 + r), 1) for r in range(repeats))}
    for c in [1, *concurrency]:
        rates = []
        for r in range(repeats):
            p = _prompts(c, prompt_len, vocab, 300 + c + r)
            rates.append(c * (decode_tokens - 1) / (cpu(p, decode_tokens) - cpu(p, 1)))
        res[f"decode_b{c}_tok_s"] = statistics.median(rates)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="checkpoint (e.g. a random 0.8B-shaped one: /tmp/r08b)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="none,int8", help="none and/or int8")
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per mode, alternated")
    ap.add_argument("--repeats", type=int, default=2, help="runs per measurement in a round")
    ap.add_argument("--cpu-time", action="store_true", help="time in process CPU seconds")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    conc = [int(c) for c in args.concurrency.split(",") if c]
    report = {"threads": args.threads, "cpu_time": args.cpu_time,
              "load_average": {"start": list(os.getloadavg())}}
    for q in args.quantization.split(","):
        quant = None if q == "none" else q
        llm = load_ours(args.model, "bfloat16", args.prefill_len, args.decode_tokens, conc,
                        args.prompt_len, quant, batch_invariant=True)
        backend = llm.engine.runner.backend
        runs = {"off": [], "on": []}
        for r in range(args.rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                backend.invariant = mode == "on"  # the kernels are chosen per call by it
                if args.cpu_time:
                    res = bench_cpu(llm, args.prefill_len, args.decode_tokens, conc,
                                    args.prompt_len, args.repeats)
                else:
                    res, _ = bench_ours(llm, args.prefill_len, args.decode_tokens, conc,
                                        args.prompt_len, args.repeats, interleave=False)
                runs[mode].append(res)
        med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for m, rs in runs.items()}
        rows = {k: {"off": med["off"][k], "on": med["on"][k],
                    "on_over_off": med["on"][k] / med["off"][k]}
                for k in med["off"] if not k.startswith("aggregate")}
        report[q] = {"rows": rows, "rounds": runs}
        unit = "tokens per CPU second" if args.cpu_time else "tok/s"
        print(f"weights {q} ({args.threads} threads), {unit}, medians of {args.rounds} "
              f"alternated rounds:")
        for k, r in rows.items():
            print(f"  {k:<20} off {r['off']:9.2f}  on {r['on']:9.2f}  on/off "
                  f"{r['on_over_off']:.3f}")
        del llm, backend
        gc.collect()
    report["load_average"]["end"] = list(os.getloadavg())
    print(f"load average: start {report['load_average']['start']}, "
          f"end {report['load_average']['end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
