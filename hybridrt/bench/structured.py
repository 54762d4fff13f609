"""``hybridrt bench structured``: what structured outputs cost.

The mean decode-step time with a JSON-schema constraint on every request against none, at each
batch size, rounds alternated (off, on) in one process; and a typical schema's compile time,
cold (the first compile also reads the vocabulary into the grammar engine), a second schema, and
cached. Decode steps are timed by the engine itself (``LLMEngine.step_costs``, kind "decode");
``cpu_time``: in this process's CPU time (a busy machine; with one thread). Needs a grammar engine
(the ``structured`` extra). docs/structured_outputs.md has the figures.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from hybridrt.sampling_params import SamplingParams, StructuredOutputsParams
from hybridrt.specdec.stats import StepCosts

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string",
                                                         "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
    "role": {"enum": ["admin", "user", "guest"]}, "score": {"type": "number"},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "tags", "address", "role", "score", "active"]}


def decode_step_ms(llm, batch: int, constrained: bool, tokens: int,
                   clock=time.perf_counter) -> tuple[float, int]:
    """``batch`` requests of ``tokens`` sampled tokens, each under ``SCHEMA`` or none ->
    (mean ms of a decode step, decode steps)."""
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=True,
                             structured_outputs=so) for i in range(batch)]
    vocab = llm.config.vocab_size
    prompts = [[(100 + (7 * i + j) % 5000) % vocab for j in range(16)] for i in range(batch)]
    llm.engine.step_costs = StepCosts(clock=clock)
    llm.generate(prompts, params, use_tqdm=False)
    c = llm.engine.step_costs
    return 1e3 * c.mean("decode"), c.counts["decode"]


def compile_times(llm) -> dict:
    """Seconds to compile ``SCHEMA`` the first time, another schema, then ``SCHEMA`` again."""
    so = llm.engine.structured_outputs
    times = {}
    for key, schema in (("compile_first_s", SCHEMA),
                        ("compile_new_schema_s", {**SCHEMA, "title": "another"}),
                        ("compile_cached_s", SCHEMA)):
        t0 = time.perf_counter()
        so.compile(StructuredOutputsParams(json=schema))
        times[key] = time.perf_counter() - t0
    return times


def run(model: str | None = None, threads: int | None = 2, batches: tuple[int, ...] = (1, 32),
        rounds: int = 3, tokens: int = 24, cpu_time: bool = False,
        json_path: str | os.PathLike | None = None, verbose: bool = True,
        engine: dict | None = None) -> dict:
    """``engine``: further ``LLM`` keyword arguments (the command line's model options but
    those the benchmark sets itself)."""
    from hybridrt.bench import progress
    from hybridrt.llm import LLM

    pbar = progress.bar("structured", 2 + len(batches) * (1 + 2 * rounds), enabled=verbose)
    clock = time.process_time if cpu_time else time.perf_counter
    progress.step(pbar, "loading")
    llm = LLM(model, **(engine or {}), threads=threads, max_model_len=256,
              max_num_seqs=max(batches))
    pbar.update()
    progress.step(pbar, "compiling the schema")
    report = {"model": str(llm.model_path), "threads": threads, "rounds": rounds,
              "tokens": tokens, "clock": "cpu" if cpu_time else "wall",
              **compile_times(llm), "batches": {}}
    pbar.update()
    for batch in batches:
        progress.step(pbar, f"warm-up, batch {batch}")
        decode_step_ms(llm, batch, True, 4)  # warm
        pbar.update()
        res: dict[bool, list] = {False: [], True: []}
        for r in range(rounds):
            for constrained in (False, True):
                progress.step(pbar, f"round {r + 1}, batch {batch}, schema "
                                    f"{'on' if constrained else 'off'}")
                res[constrained].append(decode_step_ms(llm, batch, constrained, tokens, clock))
                pbar.update()
        off = statistics.median(ms for ms, _ in res[False])
        on = statistics.median(ms for ms, _ in res[True])
        report["batches"][batch] = {"decode_step_ms_off": off, "decode_step_ms_on": on,
                                    "ratio": on / off, "rounds_off": res[False],
                                    "rounds_on": res[True]}
    pbar.close()
    if verbose:
        print(table(report))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


def table(report: dict) -> str:
    lines = [f"schema compile: first {report['compile_first_s'] * 1e3:.1f} ms, a new schema "
             f"{report['compile_new_schema_s'] * 1e3:.1f} ms, cached "
             f"{report['compile_cached_s'] * 1e3:.2f} ms",
             f"| batch | decode step ms, none | with a JSON schema | on / off ({report['clock']}"
             f" time, median of {report['rounds']}) |", "| ---: | ---: | ---: | ---: |"]
    for batch, r in report["batches"].items():
        lines.append(f"| {batch} | {r['decode_step_ms_off']:.2f} | {r['decode_step_ms_on']:.2f}"
                     f" | **{r['ratio']:.3f}** |")
    return "\n".join(lines)
