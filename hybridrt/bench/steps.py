"""``hybridrt bench steps``: where a decode step goes, call by call.

Time per engine step spent in each compiled call (the fused GDN and attention layers, the norms,
the bf16 GEMV / GEMM, the int8 and int4 products, the LM head) for B sequences decoding side by
side; several batch sizes and weight kinds in one run, their rounds alternated, so that their
ratios come from the same minutes of the machine.

Each call is wrapped with a timer (a microsecond or two per call) for the run and unwrapped
after it; the rest of a step is Python, sampling and scheduling. Where a step's layers run as
one compiled call (kernels/step.py) that call is one row, "layers (one call)"; ``no_program``
calls them one by one (the backend's step program off, as ``HYBRIDRT_STEP_PROGRAM=0`` has it),
each kernel its own row. The LM head's row counts its product again (half_gemm, gemv_bf16 or
the int8 or int4 products include it). Per (weights, batch) the figures are medians over the
rounds; "x b1" is the tokens per second over batch 1's of the same weights. ``cpu_time``:
every time in this process's CPU seconds (with one thread, the step on a core of its own, the
other processes of a busy machine then counting only through the memory bandwidth they take).
The cache must hold all B requests at once (``cache_memory``), else the run stops with a
``ValueError``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

from hybridrt.sampling_params import SamplingParams

CALLS = ("gdn_fused", "attn_decode", "rms_norm", "gemv_bf16", "half_gemm", "gemv_rows",
         "gemm_lanes")


class CallTimers:
    """Timers around the compiled calls and the engines' LM heads, adding into ``total``
    (seconds) and ``calls`` (counts) per label; ``restore()`` puts the originals back."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.total: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self._wrapped: list[tuple[object, str, object | None]] = []

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return
        total, calls, clock = self.total, self.calls, self.clock

        def timed(*a, **k):
            t = clock()
            out = fn(*a, **k)
            total[label] += clock() - t
            calls[label] += 1
            return out
        self._wrapped.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, timed)

    def wrap_kernels(self) -> None:
        from hybridrt.kernels import int4, native, quant
        from hybridrt.kernels.step import StepProgram

        for name in CALLS:
            self.wrap(native, name, name)
        self.wrap(quant, "linear", "int8 products")
        self.wrap(int4, "linear", "int4 products")
        self.wrap(StepProgram, "run", "layers (one call)")

    def clear(self) -> None:
        self.total.clear()
        self.calls.clear()

    def restore(self) -> None:
        for owner, name, original in reversed(self._wrapped):
            if original is None:  # a method looked up through the class
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._wrapped.clear()


def measure(llm, batch: int, steps: int, timers: CallTimers) -> tuple[float, dict, dict]:
    """``steps`` decode steps of ``batch`` sequences -> (seconds a step, ms a step per call,
    calls a step)."""
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        eng.add_request(list(range(10 + i, 26 + i)), sp)
    for _ in range(4):  # the prompts' prefill, then a few decode steps
        eng.step()
    if len(eng.scheduler.running) < batch:
        running = len(eng.scheduler.running)
        while eng.has_unfinished_requests():
            eng.step()
        raise ValueError(f"only {running} of {batch} requests fit the cache: raise "
                         f"--cache-memory")
    timers.clear()
    t0 = timers.clock()
    for _ in range(steps):
        eng.step()
    step = (timers.clock() - t0) / steps
    ms = {k: v / steps * 1e3 for k, v in timers.total.items()}
    per = {k: v / steps for k, v in timers.calls.items()}
    while eng.has_unfinished_requests():  # the last tokens; their requests leave
        eng.step()
    return step, ms, per


def run(model: str | None = None, batches: tuple[int, ...] = (1,), steps: int = 32,
        rounds: int = 3, threads: int | None = 2, quantizations: tuple[str | None, ...] = (None,),
        dtype: str = "bfloat16", cache_memory: str | float = 0.2, max_model_len: int = 512,
        cpu_time: bool = False, no_program: bool = False,
        json_path: str | os.PathLike | None = None, verbose: bool = True,
        engine: dict | None = None) -> dict:
    """One engine per weight kind (``None``: the checkpoint's dtype; ``"int8"``, ``"int4"``),
    a warm-up of every (kind, batch), then ``rounds`` alternated rounds -> the report: per
    kind and batch the median step time, tok/s and ms a step per call. ``engine``: further
    ``LLM`` keyword arguments (the command line's model options but those the benchmark sets
    itself)."""
    from hybridrt.bench import progress
    from hybridrt.llm import LLM

    shapes = len(quantizations) * len(batches)
    pbar = progress.bar("steps", len(quantizations) + shapes * (1 + rounds), enabled=verbose)
    timers = CallTimers(time.process_time if cpu_time else time.perf_counter)
    load = [os.getloadavg()[0]]
    runs: dict[tuple, list] = collections.defaultdict(list)
    try:
        timers.wrap_kernels()
        llms = {}
        for q in quantizations:
            progress.step(pbar, f"loading {q or dtype}")
            llms[q] = LLM(model, **(engine or {}), dtype=dtype, quantization=q,
                          max_num_seqs=max(batches),
                          max_model_len=max_model_len, cache_memory=cache_memory,
                          threads=threads)
            backend = llms[q].engine.runner.model.backend
            if no_program:  # the decode layers called one by one (as HYBRIDRT_STEP_PROGRAM=0)
                backend.options = dataclasses.replace(backend.options, step_program=False)
            timers.wrap(backend, "logits", "LM head (logits)")
            pbar.update()
        for q in quantizations:  # warm-up: every shape once
            for b in batches:
                progress.step(pbar, f"warm-up {q or dtype}, batch {b}")
                measure(llms[q], b, 2, timers)
                pbar.update()
        for r in range(rounds):
            for q in quantizations:
                for b in batches:
                    progress.step(pbar, f"round {r + 1}: {q or dtype}, batch {b}")
                    runs[q, b].append(measure(llms[q], b, steps, timers))
                    pbar.update()
    finally:
        timers.restore()
        pbar.close()
    load.append(os.getloadavg()[0])
    report = {"model": str(llms[quantizations[0]].model_path), "threads": threads,
              "steps": steps, "rounds": rounds, "clock": "cpu" if cpu_time else "wall",
              "step_program": not no_program, "load_average": load, "batches": list(batches),
              "weights": {}}
    for q in quantizations:
        step = {b: statistics.median(r[0] for r in runs[q, b]) for b in batches}
        first = runs[q, batches[0]]
        labels = sorted({k for b in batches for r in runs[q, b] for k in r[1]},
                        key=lambda k: -statistics.median(r[1].get(k, 0) for r in first))
        report["weights"][q or dtype] = {
            "step_ms": {b: step[b] * 1e3 for b in batches},
            "tok_s": {b: b / step[b] for b in batches},
            "calls": {k: {"ms": {b: statistics.median(r[1].get(k, 0.0) for r in runs[q, b])
                                 for b in batches},
                          "per_step": statistics.median(r[2].get(k, 0.0)
                                                        for r in runs[q, batches[-1]])}
                      for k in labels}}
    if verbose:
        print(table(report))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


def table(report: dict) -> str:
    batches = report["batches"]
    lines = [f"load average {report['load_average'][0]:.2f} -> "
             f"{report['load_average'][1]:.2f}; {report['threads']} threads; "
             f"{report['steps']} steps x {report['rounds']} alternated rounds, medians"
             + ("; CPU TIME" if report["clock"] == "cpu" else "")]
    for name, w in report["weights"].items():
        lines.append(f"\n{name + ' weights':<20}" + "".join(f"{'batch ' + str(b):>12}"
                                                            for b in batches))
        lines.append(f"{'step ms':<20}" + "".join(f"{w['step_ms'][b]:>12.2f}" for b in batches))
        lines.append(f"{'tok/s':<20}" + "".join(f"{w['tok_s'][b]:>12.1f}" for b in batches))
        if batches[0] == 1:
            lines.append(f"{'x b1 tok/s':<20}" + "".join(
                f"{w['tok_s'][b] / w['tok_s'][1]:>12.2f}" for b in batches))
        for k, c in w["calls"].items():
            lines.append(f"{k:<20}" + "".join(f"{c['ms'][b]:>12.2f}" for b in batches)
                         + f"   ms/step ({c['per_step']:.0f} calls)")
    return "\n".join(lines)
