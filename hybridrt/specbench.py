"""Speculative-decoding benchmark (``hybridrt bench spec``): the same prompts with k = 0..4 MTP
drafts, batch 1 and 8.

One ``LLM`` (with ``speculative_tokens = max(ks)``) serves every run; each run sets k per call,
so all rows share weights, cache and process. Per (batch size, k) it reports output tok/s, the
speedup over k = 0 at the same batch size, the mean acceptance length (1 + accepted / verify
rounds, the bonus token included) and the per-position acceptance rate (rounds that accepted
draft i / rounds). Decoding is greedy by default, so every k must reproduce k = 0's tokens
(``identical_to_k0``). Timings on shared machines are noisy: compare rows of one run.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from hybridrt.sampling_params import SamplingParams

DEFAULT_QUESTIONS = [
    "What does json.dumps do?",
    "How do I read a file line by line in Python?",
    "What is the difference between a list and a tuple?",
    "Explain what a list comprehension is.",
    "Write a function that reverses a string.",
    "How does binary search work?",
    "What is a hash table?",
    "What does the zip function return?",
]


def default_prompts(llm, n: int = 8, length: int = 16, seed: int = 0) -> list:
    """Chat-formatted generic questions when the model has a tokenizer with a chat template;
    else ``n`` random token-id prompts of ``length`` tokens."""
    tok = llm.tokenizer
    if tok is not None and getattr(tok, "chat_template", None):
        qs = [DEFAULT_QUESTIONS[i % len(DEFAULT_QUESTIONS)] for i in range(n)]
        return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in qs]
    g = torch.Generator().manual_seed(seed)
    vocab = llm.config.vocab_size
    low = min(3, vocab - 1)
    return [torch.randint(low, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _prompt_len(llm, p) -> int:
    if isinstance(p, str):
        if llm.tokenizer is None:
            raise ValueError("string prompts need a model with a tokenizer; pass token ids")
        return len(llm.tokenizer.encode(p, add_special_tokens=False))
    return len(p)


def _spec_summary(outs, k: int) -> dict:
    rounds = accepted = drafts = 0
    per_pos = [0.0] * k
    for o in outs:
        s = o.metrics.get("spec")
        if not s:
            continue
        rounds += s["num_rounds"]
        accepted += s["num_accepted"]
        drafts += s["num_draft_tokens"]
        for i, r in enumerate(s["per_position_acceptance"][:k]):
            per_pos[i] += r * s["num_rounds"]
    if k == 0 or rounds == 0:
        return {"num_rounds": rounds, "mean_acceptance_length": None, "acceptance_rate": None,
                "per_position_acceptance": []}
    return {
        "num_rounds": rounds,
        "mean_acceptance_length": 1.0 + accepted / rounds,
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "per_position_acceptance": [a / rounds for a in per_pos],
    }


def run_spec_bench(
    model,
    ks: Sequence[int] = (0, 1, 2, 3, 4),
    batch_sizes: Sequence[int] = (1, 8),
    prompts: Sequence | None = None,
    max_tokens: int = 64,
    dtype: str = "float32",
    threads: int = 2,
    json_path: str | Path | None = None,
    quick: bool = False,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    verbose: bool = True,
    quantization: str | None = None,
) -> dict:
    """Run every (batch size, k) on the same prompts -> report dict (also printed as a table
    and written to ``json_path`` when given).

    prompts: strings (the model needs a tokenizer) or token-id lists; default: chat-formatted
    generic questions, or random token ids for models without a chat template. For batch size
    b the prompts run in consecutive groups of b concurrent requests. ``quick``: 4 prompts and
    at most 8 new tokens, for smoke tests on tiny models.
    """
    from hybridrt.llm import LLM

    ks = sorted({int(k) for k in ks})
    batch_sizes = sorted({int(b) for b in batch_sizes})
    if not ks or ks[0] < 0:
        raise ValueError(f"ks must be integers >= 0, got {ks}")
    if not batch_sizes or batch_sizes[0] <= 0:
        raise ValueError(f"batch sizes must be positive, got {batch_sizes}")
    if quick:
        max_tokens = min(max_tokens, 8)
    before_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(model, dtype=dtype, speculative_tokens=max(ks), quantization=quantization,
                  max_num_seqs=max(batch_sizes), max_model_len=_max_len_hint(model, 4096))
        if prompts is None:
            prompts = default_prompts(llm, n=4 if quick else 8)
        prompts = list(prompts)
        if quick:
            prompts = prompts[:4]
        if not prompts:
            raise ValueError("no prompts")
        longest = max(_prompt_len(llm, p) for p in prompts)
        need = longest + max_tokens + max(ks) + 1
        if need > llm.engine.engine_config.max_model_len:
            raise ValueError(f"prompts of {longest} tokens + {max_tokens} new tokens exceed "
                             f"max_model_len {llm.engine.engine_config.max_model_len}")
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                ignore_eos=ignore_eos, seed=0 if temperature > 0 else None)
        warm = params.clone(max_tokens=2)
        for k in ks:
            llm.generate(prompts[:1], warm, use_tqdm=False, speculative_tokens=k)

        rows = []
        for b in batch_sizes:
            base_tokens = None
            base_rate = None
            for k in ks:
                outs, seconds = [], 0.0
                for i in range(0, len(prompts), b):
                    group = prompts[i:i + b]
                    t = time.perf_counter()
                    res = llm.generate(group, params, use_tqdm=False, speculative_tokens=k)
                    seconds += time.perf_counter() - t
                    for o in res:
                        if o.error is not None:
                            raise o.error
                    outs.extend(res)
                toks = [o.outputs[0].token_ids for o in outs]
                n_tok = sum(len(t) for t in toks)
                rate = n_tok / seconds if seconds > 0 else 0.0
                if k == ks[0]:
                    base_tokens, base_rate = toks, rate
                row = {
                    "batch_size": b,
                    "k": k,
                    "num_requests": len(outs),
                    "generated_tokens": n_tok,
                    "seconds": seconds,
                    "tok_s": rate,
                    "speedup": rate / base_rate if ks[0] == 0 and base_rate else None,
                    **_spec_summary(outs, k),
                    "identical_to_k0": (toks == base_tokens) if ks[0] == 0 else None,
                }
                rows.append(row)
                if verbose:
                    print(f"batch {b} k {k}: {rate:.1f} tok/s", file=sys.stderr)
        report = {
            "model": str(model),
            "dtype": str(dtype),
            "threads": threads,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "num_prompts": len(prompts),
            "ks": ks,
            "batch_sizes": batch_sizes,
            "rows": rows,
        }
    finally:
        torch.set_num_threads(before_threads)
    if verbose:
        print(format_table(report))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=2))
        if verbose:
            print(f"wrote {json_path}", file=sys.stderr)
    return report


def _max_len_hint(model, cap: int) -> int:
    """max_model_len for the benchmark LLM: the model's max positions, capped."""
    from hybridrt.loader import load_config, resolve_model_path

    cfg = load_config(resolve_model_path(model))
    return min(cfg.max_position_embeddings, cap)


def format_table(report: dict) -> str:
    head = (f"{'batch':>5} {'k':>2} {'tok/s':>9} {'speedup':>8} {'accept len':>10} "
            f"{'same as k0':>10}  per-position acceptance")
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        al = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "-"
        same = {True: "yes", False: "NO", None: "-"}[r["identical_to_k0"]]
        pp = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]) or "-"
        lines.append(f"{r['batch_size']:>5} {r['k']:>2} {r['tok_s']:>9.1f} {sp:>8} {al:>10} "
                     f"{same:>10}  {pp}")
    return "\n".join(lines)
