"""``hybridrt bench prefix-policy``: what each GDN checkpoint placement costs and buys.

Prompt tokens prefilled, hit rate and checkpoints saved / held for several placements, on four
chat-shaped workloads of token ids (docs/prefix_cache.md, "The policy measured"). Counts only,
no timing, so a busy machine gives the same figures.

The placements: message starts (``<|im_start|>``) on or off, the token interval (0: none), and
whether branch points are found (statecache/branch_points.py: the queued prompts' common
prefixes, the end of the cached blocks a prompt matches) and the interval's lead-in (256, 512,
... before the first interval position) is placed: "today's" is the policy before them. The
position before a prompt's last token and the end of every request are saved in all of them.
Workloads, each on an emptied cache large enough that nothing is evicted (the figures are the
placement's, not the budget's), sizes scaled by ``scale`` (1.0: the sizes below):

- ``shared``: 16 requests at once, a 1,500-token system message and a 64-token question each;
- ``agent``: a 6-message history (1,400 tokens), branched 3 ways (a 100-token message each),
  each branch answered, then continued by one more message;
- ``chat``: 4 conversations x 6 turns, interleaved, each turn the previous prompt + its
  answer + a 120-token user message;
- ``document``: 8 requests sharing a 3,000-token text without messages, a 50-token tail each;
- ``raw``: 7 requests sharing a 700-token text without messages, a 20-token tail each, one after
  another.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from hybridrt.bench.progress import bar, step
from hybridrt.sampling_params import SamplingParams
from hybridrt.statecache import prefix as prefix_policy
from hybridrt.statecache.branch_points import BranchPoints

# (label, checkpoint at message starts, token interval, branch points and lead-in)
POLICIES = [("messages + 2048 (default)", True, 2048, True),
            ("today's: messages + 2048", True, 2048, False),
            ("messages + 512", True, 512, True), ("messages + 256", True, 256, True),
            ("messages + 64", True, 64, True), ("messages only", True, 0, True),
            ("2048 only, nothing found", False, 2048, False)]
WORKLOADS = ("shared", "agent", "chat", "document", "raw")


def _ids(n: int, vocab: int, g: torch.Generator, start: int) -> list[int]:
    ids = torch.randint(10, vocab, (max(1, n),), generator=g).tolist()
    return [t if t != start else t + 1 for t in ids]


def _msg(n: int, vocab: int, g: torch.Generator, start: int) -> list[int]:
    return [start] + _ids(n - 1, vocab, g, start)


def _run(llm, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    eng = llm.engine
    rids = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished_requests():
        eng.step()
    return [list(eng.pop_request(r).output_token_ids) for r in rids]


def workloads(vocab: int, start: int, scale: float = 1.0) -> dict:
    """name -> fn(llm, params) running that workload; a fresh generator per call of this, so
    every placement sees the same token ids."""
    g = torch.Generator().manual_seed(0)
    gen = [start, 11]  # the generation prompt's message start and one token

    def n(tokens: int) -> int:
        return max(2, round(tokens * scale))

    def shared(llm, params):
        system = _msg(n(1500), vocab, g, start)
        _run(llm, [system + _msg(n(64), vocab, g, start) + gen for _ in range(16)], params)

    def agent(llm, params):
        history = _msg(n(400), vocab, g, start)
        for _ in range(5):
            history += _msg(n(200), vocab, g, start)
        branches = [history + _msg(n(100), vocab, g, start) + gen for _ in range(3)]
        answers = _run(llm, branches, params)
        _run(llm, [b + a + _msg(n(100), vocab, g, start) + gen
                   for b, a in zip(branches, answers)], params)

    def chat(llm, params):
        convs = [_msg(n(300), vocab, g, start) for _ in range(4)]
        for _ in range(6):
            prompts = [c + _msg(n(120), vocab, g, start) + gen for c in convs]
            answers = _run(llm, prompts, params)
            convs = [p + a for p, a in zip(prompts, answers)]

    def document(llm, params):
        doc = _ids(n(3000), vocab, g, start)
        _run(llm, [doc + _ids(n(50), vocab, g, start) for _ in range(8)], params)

    def raw(llm, params):
        text = _ids(n(700), vocab, g, start)
        for _ in range(7):
            _run(llm, [text + _ids(n(20), vocab, g, start)], params)

    return {"shared": shared, "agent": agent, "chat": chat, "document": document, "raw": raw}


def run(model: str | None = None, threads: int | None = 2, scale: float = 1.0,
        max_tokens: int = 16, cache_memory: str = "6GiB", max_model_len: int = 4096,
        chosen: tuple[str, ...] = WORKLOADS, json_path: str | os.PathLike | None = None,
        verbose: bool = True, engine: dict | None = None) -> dict:
    """Every workload under every placement of ``POLICIES`` on one engine -> the report (one
    row per workload and placement). ``engine``: further ``LLM`` keyword arguments (the
    command line's model options but those the benchmark sets itself)."""
    from hybridrt.llm import LLM

    pb = bar("prefix-policy", 1 + len(chosen) * len(POLICIES), unit="run", enabled=verbose)
    step(pb, "loading")
    llm = LLM(model, **(engine or {}), threads=threads, max_model_len=max_model_len,
              max_num_seqs=16,
              cache_memory=cache_memory, checkpoint_share=0.5)
    eng = llm.engine
    messages = frozenset(eng.checkpoint_boundary_ids)
    if not messages:
        raise ValueError("this model's tokenizer has no message-start token (<|im_start|>): "
                         "the workloads need one")
    start = min(messages)
    sizing = eng.cache.sizing
    per_ckpt = sizing.bytes_per_slot
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    report = {"model": str(llm.model_path), "bytes_per_checkpoint": per_ckpt,
              "checkpoint_slots": sizing.num_checkpoint_slots,
              "request_slots": sizing.num_request_slots, "scale": scale, "rows": []}
    pb.update()
    if verbose:
        print(table(report), flush=True)  # the header; the rows as they come
    args0, boundaries0 = eng.args, eng.checkpoint_boundary_ids
    lead_in0 = prefix_policy.LEAD_IN
    try:
        for name in chosen:
            for label, use_messages, interval, found in POLICIES:
                llm.reset_prefix_cache()
                eng.checkpoint_boundary_ids = messages if use_messages else frozenset()
                eng.args = dataclasses.replace(args0, checkpoint_interval=interval)
                eng.scheduler.branch_points = BranchPoints() if found else None
                prefix_policy.LEAD_IN = lead_in0 if found else 1 << 62
                before = dict(eng.cache.prefix.stats)
                pre0 = eng.stats["num_prefill_tokens"]
                step(pb, f"{name}, {label}")
                workloads(llm.config.vocab_size, start, scale)[name](llm, params)
                pb.update()
                st = {k: v - before.get(k, 0) for k, v in eng.cache.prefix.stats.items()}
                held = eng.cache.usage().num_checkpoints
                row = {"workload": name, "placement": label,
                       "query_tokens": st["query_tokens"],
                       "prefilled": eng.stats["num_prefill_tokens"] - pre0,
                       "hit_rate": st["hit_tokens"] / max(1, st["query_tokens"]),
                       "checkpoints_saved": st["checkpoints_saved"],
                       "checkpoint_evictions": st["checkpoint_evictions"], "held": held,
                       "mib_held": held * per_ckpt / 2**20}
                report["rows"].append(row)
                if verbose:
                    print(_row(row), flush=True)
    finally:
        pb.close()
        eng.args, eng.checkpoint_boundary_ids = args0, boundaries0
        eng.scheduler.branch_points = BranchPoints()
        prefix_policy.LEAD_IN = lead_in0
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _row(r: dict) -> str:
    return (f"| {r['workload']} | {r['placement']} | {r['query_tokens']} | {r['prefilled']} | "
            f"{r['hit_rate']:.3f} | {r['checkpoints_saved']} | {r['held']} | "
            f"{r['mib_held']:.1f} |")


def table(report: dict) -> str:
    lines = [f"checkpoint: {report['bytes_per_checkpoint'] / 2**20:.2f} MiB; slots "
             f"{report['checkpoint_slots']} + {report['request_slots']}",
             "| workload | placement | tokens looked up | prefilled | hit rate | checkpoints "
             "saved | held at the end | MiB held |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    return "\n".join(lines + [_row(r) for r in report["rows"]])
