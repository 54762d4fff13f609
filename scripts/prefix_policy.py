"""What each checkpoint placement costs and buys (docs/prefix_cache.md, "The policy measured"):
prompt tokens prefilled, hit rate and checkpoints saved / held for several placements, on four
chat-shaped workloads of token ids. Counts only (no timing), so a busy machine gives the same
figures.

    python scripts/prefix_policy.py [CHECKPOINT] [--threads 2]

CHECKPOINT: default the demo model. The placements: message starts (``<|im_start|>``) on or off,
and the token interval (0 = none); the position before a prompt's last token and the end of
every request are saved in all of them. Workloads (each on an emptied cache, large enough that
nothing is evicted, so the figures are the placement's, not the budget's):

- ``shared``: 16 requests at once, a 1,500-token system message and a 64-token question each;
- ``agent``: a 6-message history (1,400 tokens), branched 3 ways (a 100-token message each), each
  branch answered, then continued by one more message;
- ``chat``: 4 conversations x 6 turns, interleaved, each turn the previous prompt + its answer +
  a 120-token user message;
- ``document``: 8 requests sharing a 3,000-token text without messages, a 50-token tail each.
"""

from __future__ import annotations

import argparse
import json

import torch

from hybridrt import LLM, SamplingParams

POLICIES = [("messages + 2048 (default)", True, 2048), ("messages only", True, 0),
            ("2048 only", False, 2048), ("messages + 512", True, 512), ("512 only", False, 512)]


def _ids(n: int, vocab: int, g: torch.Generator, start: int) -> list[int]:
    ids = torch.randint(10, vocab, (n,), generator=g).tolist()
    return [t if t != start else t + 1 for t in ids]


def _msg(n: int, vocab: int, g: torch.Generator, start: int) -> list[int]:
    return [start] + _ids(n - 1, vocab, g, start)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    eng = llm.engine
    rids = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished_requests():
        eng.step()
    return [list(eng.pop_request(r).output_token_ids) for r in rids]


def workloads(vocab: int, start: int):
    g = torch.Generator().manual_seed(0)
    gen = [start, 11]  # the generation prompt's message start and one token

    def shared(llm, params):
        system = _msg(1500, vocab, g, start)
        _run(llm, [system + _msg(64, vocab, g, start) + gen for _ in range(16)], params)

    def agent(llm, params):
        history = _msg(400, vocab, g, start)
        for _ in range(5):
            history += _msg(200, vocab, g, start)
        branches = [history + _msg(100, vocab, g, start) + gen for _ in range(3)]
        answers = _run(llm, branches, params)
        _run(llm, [b + a + _msg(100, vocab, g, start) + gen for b, a in zip(branches, answers)],
             params)

    def chat(llm, params):
        convs = [_msg(300, vocab, g, start) for _ in range(4)]
        for _ in range(6):
            prompts = [c + _msg(120, vocab, g, start) + gen for c in convs]
            answers = _run(llm, prompts, params)
            convs = [p + a for p, a in zip(prompts, answers)]

    def document(llm, params):
        doc = _ids(3000, vocab, g, start)
        _run(llm, [doc + _ids(50, vocab, g, start) for _ in range(8)], params)

    return {"shared": shared, "agent": agent, "chat": chat, "document": document}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    llm = LLM(a.model, threads=a.threads, max_model_len=4096, max_num_seqs=16,
              cache_memory="6GiB", checkpoint_share=0.5)
    eng = llm.engine
    messages = frozenset(eng.checkpoint_boundary_ids)
    start = min(messages)
    per_ckpt = eng.cache.sizing.bytes_per_slot
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    rows = []
    print(f"checkpoint: {per_ckpt / 2**20:.2f} MiB; slots {eng.cache.sizing.num_checkpoint_slots}"
          f" + {eng.cache.sizing.num_request_slots}")
    print("| workload | placement | tokens looked up | prefilled | hit rate | checkpoints saved | "
          "held at the end | MiB held |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in ("shared", "agent", "chat", "document"):
        for label, use_messages, interval in POLICIES:
            llm.reset_prefix_cache()
            eng.checkpoint_boundary_ids = messages if use_messages else frozenset()
            eng.checkpoint_interval = interval
            before = dict(eng.cache.prefix.stats)
            pre0 = eng.stats["num_prefill_tokens"]
            # A fresh generator per placement: the same token ids for every placement.
            workloads(llm.config.vocab_size, start)[name](llm, params)
            st = {k: v - before.get(k, 0) for k, v in eng.cache.prefix.stats.items()}
            held = eng.cache.usage().num_checkpoints
            row = {"workload": name, "placement": label, "query_tokens": st["query_tokens"],
                   "prefilled": eng.stats["num_prefill_tokens"] - pre0,
                   "hit_rate": st["hit_tokens"] / max(1, st["query_tokens"]),
                   "checkpoints_saved": st["checkpoints_saved"],
                   "checkpoint_evictions": st["checkpoint_evictions"], "held": held,
                   "mib_held": held * per_ckpt / 2**20}
            rows.append(row)
            print(f"| {name} | {label} | {row['query_tokens']} | {row['prefilled']} | "
                  f"{row['hit_rate']:.3f} | {row['checkpoints_saved']} | {held} | "
                  f"{row['mib_held']:.1f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bytes_per_checkpoint": per_ckpt, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
