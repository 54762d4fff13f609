"""``hybridrt bench preemption``: the scheduler under memory pressure, both admission rules.

    hybridrt bench preemption [MODEL] [--dtype bfloat16] [--cache-memory 12MiB]
        [--rounds 1] [--check-alone] [--json out.json]

Issue 29's workload: one long request (3,000 prompt + 1,000 generated tokens) beside six
short ones (1,000 + 400), random prompt ids, greedy with EOS ignored, max_num_seqs 8, in a
cache that cannot hold them all at once. Both rules run on one engine, alternated round by
round: ``admission`` (the scheduler's admission control: a waiting request joins running
ones only when the cache holds all their known tokens and its own) and ``chunk`` (the rule
before it: admit as soon as this step's prompt chunk fits; ``admission_control = False``).
Per rule: preemptions, prompt tokens prefilled again after preemptions, engine steps, wall
time (median over rounds) and generated tokens/s; whether the two rules' greedy outputs are
equal, and with ``--check-alone`` whether each equals its request run alone (exact in
float32; in bfloat16 a different batch may round differently).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

RULES = ("chunk", "admission")


def workload(vocab_size: int, long: tuple[int, int] = (3000, 1000),
             short: tuple[int, int] = (1000, 400), num_short: int = 6, seed: int = 0):
    """(prompt ids, SamplingParams) of one long request and ``num_short`` short ones: each
    (prompt tokens, generated tokens), greedy, EOS ignored."""
    import torch

    from hybridrt.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    low = min(10, vocab_size - 1)  # clear of the specials at the start of a small vocabulary
    prompts = [torch.randint(low, vocab_size, (n,), generator=g).tolist()
               for n in [long[0]] + [short[0]] * num_short]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in [long[1]] + [short[1]] * num_short]
    return prompts, params


def run_rule(llm, prompts, params, rule: str) -> dict:
    """One run of the workload under ``rule`` -> its figures and greedy outputs."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; choose from {', '.join(RULES)}")
    engine = llm.engine
    llm.reset_prefix_cache()  # every run cold: nothing cached from the one before
    scheduler = engine.scheduler
    saved = scheduler.admission_control
    scheduler.admission_control = rule == "admission"
    stats = dict(engine.stats)
    try:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
    finally:
        scheduler.admission_control = saved
    if not engine.cache.all_free():
        raise RuntimeError(f"the {rule} run left cache blocks in use")
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    generated = sum(map(len, tokens))
    return {"rule": rule, "preemptions": engine.stats["num_preemptions"]
            - stats["num_preemptions"],
            "prefilled_again": engine.stats["num_prefill_tokens"] - stats["num_prefill_tokens"]
            - sum(map(len, prompts)),
            "steps": engine.stats["num_steps"] - stats["num_steps"],
            "wall_s": wall, "generated_tokens": generated,
            "generated_tok_s": generated / wall, "outputs": tokens}


def bench(llm, prompts, params, rounds: int = 1, check_alone: bool = False,
          pbar=None) -> dict:
    """Both rules, alternated ``rounds`` times -> {"rows": one per rule, "outputs_equal": the
    rules' greedy outputs equal, "alone_equal": {rule: equal to each request run alone} or
    None}. ``pbar``: a progress bar (hybridrt.bench.progress) counting each run."""
    from hybridrt.bench import progress

    pbar = pbar if pbar is not None else progress.silent()
    runs = {rule: [] for rule in RULES}
    for r in range(rounds):
        for rule in RULES:
            progress.step(pbar, f"round {r + 1}: {rule} rule")
            runs[rule].append(run_rule(llm, prompts, params, rule))
            pbar.update()
    rows = []
    for rule, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        rows.append({"rule": rule, "preemptions": [r["preemptions"] for r in rs],
                     "prefilled_again": [r["prefilled_again"] for r in rs],
                     "steps": [r["steps"] for r in rs], "wall_s": round(wall, 2),
                     "generated_tok_s": round(rs[0]["generated_tokens"] / wall, 1)})
    outputs = {rule: rs[0]["outputs"] for rule, rs in runs.items()}
    same = all(r["outputs"] == outputs[rule] for rule, rs in runs.items() for r in rs)
    alone_equal = None
    if check_alone:
        alone = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            progress.step(pbar, f"request {i + 1} alone")
            alone.append(list(llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids))
            pbar.update()
        alone_equal = {rule: out == alone for rule, out in outputs.items()}
    return {"rows": rows, "outputs_equal": same and outputs["chunk"] == outputs["admission"],
            "alone_equal": alone_equal}


COLUMNS = ["rule", "preemptions", "prefilled_again", "steps", "wall_s", "generated_tok_s"]


def table(rows: list[dict]) -> str:
    def cell(v):
        if isinstance(v, list):
            return str(v[0]) if len(set(v)) == 1 else "/".join(map(str, v))
        return str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * (len(COLUMNS) - 1)]
    lines += ["| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def run_preemption_bench(model: str | None = None, dtype: str = "bfloat16",
                         cache_memory: int | str = "12MiB", max_model_len: int = 4096,
                         max_num_seqs: int = 8, max_num_batched_tokens: int | None = None,
                         long: tuple[int, int] = (3000, 1000),
                         short: tuple[int, int] = (1000, 400), num_short: int = 6,
                         rounds: int = 1, check_alone: bool = False,
                         threads: int | None = None, json_path: str | None = None,
                         engine: dict | None = None) -> dict:
    """Load the model, run ``bench`` -> the report; prints the table. ``engine``: further
    ``LLM`` keyword arguments (the command line's model options but those the benchmark sets
    itself)."""
    from hybridrt.bench import progress
    from hybridrt.llm import LLM

    if max(long[0] + long[1], short[0] + short[1]) > max_model_len:
        raise ValueError(f"a request of {long[0]} + {long[1]} or {short[0]} + {short[1]} "
                         f"tokens does not fit max_model_len {max_model_len}")
    pbar = progress.bar("preemption", 1 + rounds * len(RULES)
                        + (1 + num_short if check_alone else 0), unit="run")
    progress.step(pbar, "loading")
    # no share of the budget set aside for prefix-cache checkpoints: the whole budget is the
    # requests' KV and state, as the issue's workload was sized (a preempted request still
    # resumes from its own state, kept in the slot it freed)
    llm = LLM(model, **(engine or {}), dtype=dtype, max_model_len=max_model_len,
              max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, cache_memory=cache_memory,
              threads=threads, tokenizer=None, checkpoint_share=0.0)
    pbar.update()
    prompts, params = workload(llm.config.vocab_size, long, short, num_short)
    result = bench(llm, prompts, params, rounds, check_alone, pbar)
    pbar.close()
    report = {"model": model or "demo", "dtype": str(llm.dtype).removeprefix("torch."),
              "cache": llm.cache_sizing.describe(), "cache_memory": cache_memory,
              "max_num_seqs": max_num_seqs, "long": list(long), "short": list(short),
              "num_short": num_short, "rounds": rounds, "threads": threads, **result}
    print(f"{report['model']}, {report['dtype']}, {report['cache']}: one {long[0]} + "
          f"{long[1]} tokens and {num_short} of {short[0]} + {short[1]}")
    print(table(result["rows"]))
    chunk, admission = result["rows"]
    print(f"wall time chunk / admission: {chunk['wall_s'] / admission['wall_s']:.2f}x; "
          f"greedy outputs of both rules equal: {result['outputs_equal']}"
          + ("" if result["alone_equal"] is None else
             f"; equal to each request alone: {result['alone_equal']}"))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {json_path}", file=sys.stderr)
    return report
