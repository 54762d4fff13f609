"""``hybridrt bench prefix``: what the prefix cache saves, with and without it in one run.

Three engines on the same checkpoint, prefix caching on, on with ``today``'s policy (before
branch points were found and the interval had its lead-in: statecache/branch_points.py) and
off, run the same workloads in alternated rounds (on, today, off, on, ...); each round starts
with the cache emptied:

- ``shared``: ``num_requests`` requests submitted at once, sharing a ``system_tokens``-token
  system message, each with its own ``question_tokens``-token question (chat-shaped token ids:
  every message begins with the model's message-start token, ``<|im_start|>``, where the
  engine checkpoints). Reported: prompt tokens prefilled, median and p90 time to first token,
  wall time.
- ``document``: ``document_questions`` requests submitted at once, each one user message: a
  ``document_tokens``-token text without message starts, then its own ``question_tokens``-token
  question (retrieval-augmented generation, few-shot evaluation);
- ``disjoint``: ``disjoint_requests`` random prompts that share nothing: the cache's overhead
  (hashing, checkpoints, nothing to reuse); output tokens per second.

Medians over the rounds; the ratios compare the two engines' figures from the same rounds.
With caching on, the report also gives the cache's own counters over its last round: look-ups,
hits, hit tokens (hit rate: hit tokens / looked-up tokens), checkpoints saved and evicted,
checkpoints held and their bytes, blocks evicted. Multi-turn serving is ``hybridrt bench serve``
(prefix caching on and off over HTTP).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from hybridrt.bench.progress import bar, step
from hybridrt.sampling_params import SamplingParams
from hybridrt.statecache import prefix as prefix_policy


def _random(n: int, vocab: int, avoid: set[int], g: torch.Generator) -> list[int]:
    ids = torch.randint(10, vocab, (n,), generator=g).tolist()
    return [t if t not in avoid else t + 1 for t in ids]


def shared_prompts(start: int, vocab: int, num_requests: int, system_tokens: int,
                   question_tokens: int, seed: int = 0) -> list[list[int]]:
    """Chat-shaped prompts: [start] system, [start] question, [start] + one generation-prompt
    token; the system message is the same in all."""
    g = torch.Generator().manual_seed(seed)
    avoid = {start}
    system = [start] + _random(system_tokens - 1, vocab, avoid, g)
    return [system + [start] + _random(question_tokens - 1, vocab, avoid, g) + [start, 11]
            for _ in range(num_requests)]


def document_prompts(start: int, vocab: int, num_requests: int, document_tokens: int,
                     question_tokens: int, seed: int = 2) -> list[list[int]]:
    """One user message each: [start] document question, then [start] + one generation-prompt
    token; the document is the same in all."""
    g = torch.Generator().manual_seed(seed)
    doc = [start] + _random(document_tokens - 1, vocab, {start}, g)
    return [doc + _random(question_tokens, vocab, {start}, g) + [start, 11]
            for _ in range(num_requests)]


def disjoint_prompts(vocab: int, num_requests: int, length: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [_random(length, vocab, set(), g) for _ in range(num_requests)]


def _run_batch(llm, prompts, params, clock=time.perf_counter) -> dict:
    """Submit every prompt at once, step to the end -> timings and prefilled tokens
    (``wall_s`` by ``clock``: wall time, or this process's CPU time)."""
    eng = llm.engine
    before = eng.stats["num_prefill_tokens"]
    t0 = clock()
    rids = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished_requests():
        eng.step()
    wall = clock() - t0
    outs = [eng.pop_request(r) for r in rids]
    ttft = sorted(r.metrics.time_to_first_token for r in outs)
    return {"wall_s": wall, "prefilled_tokens": eng.stats["num_prefill_tokens"] - before,
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
            "output_tokens": sum(r.num_output_tokens for r in outs),
            "cached_tokens": sum(r.metrics.num_cached_tokens for r in outs)}


def cache_counters(llm, before: dict) -> dict:
    """The prefix cache's counters since ``before`` (a copy of them), and what it holds."""
    cache = llm.engine.cache
    if cache.prefix is None:
        return {}
    st = {k: v - before.get(k, 0) for k, v in cache.prefix.stats.items()}
    usage = cache.usage()
    st["hit_rate"] = round(st["hit_tokens"] / st["query_tokens"], 4) if st["query_tokens"] else 0
    st["checkpoints_held"] = usage.num_checkpoints
    st["checkpoint_bytes_held"] = usage.num_checkpoints * cache.sizing.bytes_per_slot
    st["checkpoint_slots"] = cache.sizing.num_checkpoint_slots + cache.sizing.num_request_slots
    st["bytes_per_checkpoint"] = cache.sizing.bytes_per_slot
    return st


def _median_row(rounds: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def run(model: str | None = None, threads: int | None = None, dtype: str = "auto",
        quantization: str | None = None, num_requests: int = 32, system_tokens: int = 2048,
        question_tokens: int = 64, max_tokens: int = 16, disjoint_requests: int = 64,
        disjoint_tokens: int = 128, rounds: int = 2, cache_memory: str = "4GiB",
        workloads: tuple[str, ...] = ("shared", "disjoint"), document_tokens: int = 3000,
        document_questions: int = 16,
        json_path: str | os.PathLike | None = None, verbose: bool = True,
        cpu_time: bool = False, engine: dict | None = None) -> dict:
    """``cpu_time``: the workloads' times (``wall_s``, hence output tok/s) in this process's CPU
    time, for a machine other jobs keep busy (with ``threads=1``); TTFT stays wall time.
    ``engine``: further ``LLM`` keyword arguments for both engines (the command line's model
    options but those the benchmark sets itself)."""
    from hybridrt.llm import LLM

    pb = bar("prefix", 1 + len(workloads) * rounds * 3, unit="run", enabled=verbose)
    step(pb, "loading the three engines (cache on, today's policy, off)")
    if threads is not None:
        torch.set_num_threads(threads)
    longest = max(system_tokens, document_tokens if "document" in workloads else 0)
    max_len = max(longest + question_tokens + 2, disjoint_tokens) + max_tokens + 8
    kw = {**(engine or {}), "dtype": dtype, "quantization": quantization,
          "max_model_len": max(max_len, 256),
          "max_num_seqs": max(num_requests, disjoint_requests, document_questions),
          "cache_memory": cache_memory, "threads": threads}
    engines = {"on": LLM(model, enable_prefix_caching=True, **kw),
               "today": LLM(model, enable_prefix_caching=True, **kw),
               "off": LLM(model, enable_prefix_caching=False, **kw)}
    engines["today"].engine.scheduler.branch_points = None
    pb.update()
    llm = engines["on"]
    starts = sorted(llm.engine.checkpoint_boundary_ids)
    if not starts:
        raise ValueError("this model's tokenizer has no message-start token (<|im_start|>): "
                         "the shared workload needs one")
    vocab = llm.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    report = {"model": str(llm.model_path), "dtype": str(llm.dtype).removeprefix("torch."),
              "quantization": quantization, "threads": torch.get_num_threads(),
              "rounds": rounds, "clock": "cpu" if cpu_time else "wall", "workloads": {}}
    clock = time.process_time if cpu_time else time.perf_counter
    work = {"shared": lambda: shared_prompts(starts[0], vocab, num_requests, system_tokens,
                                             question_tokens),
            "document": lambda: document_prompts(starts[0], vocab, document_questions,
                                                 document_tokens, question_tokens),
            "disjoint": lambda: disjoint_prompts(vocab, disjoint_requests, disjoint_tokens)}
    for name in workloads:
        prompts = work[name]()
        results: dict[str, list[dict]] = {key: [] for key in engines}
        counters = {}
        for _ in range(rounds):
            for key, eng in engines.items():
                eng.reset_prefix_cache()
                before = dict(eng.engine.cache.prefix.stats) if key != "off" else {}
                lead_in = prefix_policy.LEAD_IN
                if key == "today":
                    prefix_policy.LEAD_IN = 1 << 62
                step(pb, f"{name}, cache {key}")
                try:
                    results[key].append(_run_batch(eng, prompts, params, clock))
                finally:
                    prefix_policy.LEAD_IN = lead_in
                pb.update()
                if key != "off":
                    counters[key] = cache_counters(eng, before)
                if verbose:
                    r = results[key][-1]
                    pb.write(f"{name} cache {key}: prefilled "
                             f"{r['prefilled_tokens']}, TTFT p50 {r['ttft_p50_s']:.2f} s, "
                             f"{report['clock']} {r['wall_s']:.1f} s", file=sys.stderr)
        on, off, today = (_median_row(results[k]) for k in ("on", "off", "today"))
        row = {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
               "on": on, "off": off, "today": today, "rounds_on": results["on"],
               "rounds_off": results["off"], "rounds_today": results["today"],
               "prefilled_ratio": off["prefilled_tokens"] / max(1, on["prefilled_tokens"]),
               "ttft_p50_ratio": off["ttft_p50_s"] / on["ttft_p50_s"],
               "today_prefilled_ratio": today["prefilled_tokens"]
               / max(1, on["prefilled_tokens"]),
               "today_ttft_p50_ratio": today["ttft_p50_s"] / on["ttft_p50_s"],
               "throughput_ratio": (on["output_tokens"] / on["wall_s"])
               / (off["output_tokens"] / off["wall_s"]),
               "cache": counters["on"], "cache_today": counters["today"]}
        report["workloads"][name] = row
    pb.close()
    if verbose:
        print(table(report))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


def table(report: dict) -> str:
    clock = report.get("clock", "wall")
    lines = [f"| workload | cache | prefilled tokens | TTFT p50 s | TTFT p90 s | {clock} s | "
             "output tok/s |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, row in report["workloads"].items():
        for key in ("on", "today", "off"):
            r = row[key]
            lines.append(f"| {name} | {key} | {r['prefilled_tokens']:.0f} | "
                         f"{r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} | {r['wall_s']:.1f} | "
                         f"{r['output_tokens'] / r['wall_s']:.1f} |")
        c = row["cache"]
        lines.append(f"| {name} | off / on | **{row['prefilled_ratio']:.1f}x** | "
                     f"**{row['ttft_p50_ratio']:.1f}x** | | | on/off "
                     f"**{row['throughput_ratio']:.3f}** |")
        lines.append(f"| {name} | today / on | **{row['today_prefilled_ratio']:.1f}x** | "
                     f"**{row['today_ttft_p50_ratio']:.1f}x** | | | |")
        lines.append(f"| {name} | counters | hit rate {c.get('hit_rate', 0):.3f} | "
                     f"{c.get('checkpoints_saved', 0)} checkpoints saved, "
                     f"{c.get('checkpoint_evictions', 0)} evicted | "
                     f"{c.get('checkpoints_held', 0)} held | "
                     f"{c.get('checkpoint_bytes_held', 0) / 2**20:.0f} MiB | |")
    return "\n".join(lines)
