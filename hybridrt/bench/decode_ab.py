"""Decode speed of the demo model, rounds alternated between source trees: tracing off here vs
the code before it (another checkout), and, with ``--trace-on``, tracing on here.

    python -m hybridrt.bench.decode_ab /work/main . --rounds 5          # before vs tracing off
    python -m hybridrt.bench.decode_ab . --trace-on --rounds 3           # tracing off vs on

Each (round, tree) runs in a fresh process with the tree's own interpreter
(``TREE/.venv/bin/python``, else this one) in the tree's directory, so that it imports that
tree's hybridrt: B greedy requests (``--batch``) are prefilled, then ``--steps`` decode steps
are timed (one torch thread). Prints each variant's median decode tokens/s over the rounds
and its ratio to the first variant's; a machine under load moves the figures, so alternate
enough rounds and quote ``uptime``'s load average beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(batch: int, steps: int, trace: bool) -> None:
    """Runs in the tree being measured: prints {"tok_s": decode tokens per second}."""
    from hybridrt.llm import LLM
    from hybridrt.sampling_params import SamplingParams

    llm = LLM(max_model_len=512, cache_memory="256MiB", max_num_seqs=batch, threads=1)
    eng = llm.engine
    if trace:
        from hybridrt.trace import TraceRecorder

        TraceRecorder.attach(eng)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    rids = [eng.add_request([318, 353, 225 + i, 1808, 4698, 302, 35], params)
            for i in range(batch)]
    while any(not eng.get_request(r).output_token_ids for r in rids):
        eng.step()  # the prefills
    t0 = time.perf_counter()
    n = 0
    while eng.has_unfinished_requests():
        n += len(eng.step())
    print(json.dumps({"tok_s": n / (time.perf_counter() - t0)}))


def measure(tree: Path, batch: int, steps: int, trace: bool) -> float:
    python = tree / ".venv" / "bin" / "python"
    cmd = [str(python if python.exists() else sys.executable), str(Path(__file__).resolve()),
           "--child", "--batch", str(batch), "--steps", str(steps)] + (["--trace"] if trace
                                                                       else [])
    out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"error: {tree}: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", type=Path, help="source trees, first is the baseline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--trace-on", action="store_true", help="also the last tree, tracing on")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.batch, a.steps, a.trace)
        return
    if not a.trees:
        ap.error("give at least one source tree")
    variants = [(t.resolve(), False) for t in a.trees]
    if a.trace_on:
        variants.append((a.trees[-1].resolve(), True))
    rates: dict[int, list[float]] = {i: [] for i in range(len(variants))}
    for _ in range(a.rounds):
        for i, (tree, trace) in enumerate(variants):
            rates[i].append(measure(tree, a.batch, a.steps, trace))
    base = statistics.median(rates[0])
    for i, (tree, trace) in enumerate(variants):
        med = statistics.median(rates[i])
        runs = " ".join(f"{r:.1f}" for r in rates[i])
        print(f"{str(tree) + (' (trace on)' if trace else ''):<40} {med:8.1f} tok/s "
              f"x{med / base:.3f}   [{runs}]")


if __name__ == "__main__":
    main()
