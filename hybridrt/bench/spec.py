"""Speculative-decoding benchmark (``hybridrt bench spec``): the same prompts with k = 0..4 MTP
drafts, batch 1 and 8.

One ``LLM`` (with ``speculative_tokens = max(ks)``) serves every run; each run sets k per call,
so all rows share weights, cache and process. Per (batch size, k) it reports output tok/s, the
speedup over k = 0 at the same batch size, the mean acceptance length (1 + accepted / verify
rounds, the bonus token included) and the per-position acceptance rate (rounds that accepted
draft i / rounds). Decoding is greedy by default, so every k must reproduce k = 0's tokens
(``identical_to_k0``). Timings on shared machines are noisy: compare rows of one run.

``draft_vocabs``: draft-head sizes to compare, 0 being the full LM head (the LLM's draft head is
swapped between rows). ``simulate_acceptance``: acceptance rates alpha; for each, the MTP still
runs every draft pass (its cost is real) but each proposed token is replaced by the target's
own greedy continuation with probability alpha, by a wrong token otherwise, so acceptance is
controlled while verification, rollback and the rest run unchanged. The continuation comes
from an untimed run of the same prompts at the same k and batch size whose drafts are all
wrong (``_reference_run``: in bf16 it can differ from k = 0's where greedy choices are near
ties). Those rows are labelled simulated everywhere, with the fraction of drafts that had a
reference token (``reference_coverage``). Each row
also gives the measured costs (engine ``StepCosts``) relative to a k = 0 decode step: one draft
pass, one verify step, and the break-even alpha at which k drafts pay for them; and the report
gives the verify step's cost per row count (k + 1 rows per sequence) against the decode step
(``verify_cost``), the first thing that decides whether speculation can pay on a machine.
A row's speedup is the median over its runs of its tok/s over the k = 0 run before it (paired:
a drift of the machine's speed between runs minutes apart cancels); with adaptive k a k = 0
run comes before each alpha's rows, the adaptive one first (the k = 0 row's tok/s is the
median of all of them).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from hybridrt.bench.copy_workload import copy_prompts
from hybridrt.bench.progress import bar, step
from hybridrt.bench.spec_report import format_table
from hybridrt.bench.spec_sim import (
    SimulatedDrafts,
    drafts_through,
    mtp_of,
    reference_run,
    sequences,
)
from hybridrt.sampling_params import SamplingParams
from hybridrt.specdec.stats import StepCosts

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
    rounds = accepted = drafts = decisions = chosen = 0
    by_source = {"ngram": [0, 0], "mtp": [0, 0]}  # drafts, accepted
    per_pos = [0.0] * k
    for o in outs:
        s = o.metrics.get("spec")
        if not s:
            continue
        rounds += s["num_rounds"]
        accepted += s["num_accepted"]
        drafts += s["num_draft_tokens"]
        decisions += sum(s["k_chosen"])
        chosen += sum(j * n for j, n in enumerate(s["k_chosen"]))
        for src, pair in by_source.items():
            pair[0] += s["drafts_by_source"][src]
            pair[1] += s["accepted_by_source"][src]
        for i, r in enumerate(s["per_position_acceptance"][:k]):
            per_pos[i] += r * s["num_rounds"]
    if k == 0:
        return {"num_rounds": rounds, "mean_acceptance_length": None, "acceptance_rate": None,
                "per_position_acceptance": []}
    sources = {"drafts_by_source": {src: d for src, (d, _) in by_source.items()},
               "acceptance_by_source": {src: (a / d if d else None)
                                        for src, (d, a) in by_source.items()},
               "mean_k_chosen": chosen / decisions if decisions else None}
    if rounds == 0:  # nothing drafted (adaptive k chose 0 throughout)
        return {"num_rounds": 0, "mean_acceptance_length": None, "acceptance_rate": None,
                "per_position_acceptance": [], **sources}
    return {
        "num_rounds": rounds,
        "mean_acceptance_length": 1.0 + accepted / rounds,
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "per_position_acceptance": [a / rounds for a in per_pos],
        **sources,
    }


def _summary(runs: list) -> dict:
    """A row's repeated runs -> the median tok/s, the step costs and outputs of all of them
    (``all_outs``: the acceptance counts), and the outputs and simulation of the last."""
    outs, seconds, _, sim, _ = runs[-1]
    rates = [sum(len(o.outputs[0].token_ids) for o in r[0]) / r[1] for r in runs]
    paired = [rate / r[4] for rate, r in zip(rates, runs) if r[4]]
    costs = StepCosts(runs[0][2].clock)
    for r in runs:
        costs.merge(r[2])
    token_ids = [o.outputs[0].token_ids for o in outs]
    return {"outs": outs, "all_outs": [o for r in runs for o in r[0]], "sim": sim,
            "seconds": seconds, "tok_s": statistics.median(rates),
            "tok_s_runs": rates, "paired": statistics.median(paired) if paired else None,
            "costs": costs, "token_ids": token_ids,
            "tokens": sum(len(t) for t in token_ids)}


def expected_acceptance_length(alpha: float, k: int) -> float:
    """1 + alpha + ... + alpha^k: the mean acceptance length when each draft is right with
    probability alpha independently (the bonus token included)."""
    return sum(alpha ** i for i in range(k + 1))


def break_even_alpha(cost_ratio: float, k: int) -> float | None:
    """The alpha at which k drafts per round pay for themselves: expected_acceptance_length
    (alpha, k) = cost_ratio (a round's cost, drafting + verify step, over one k = 0 decode
    step). 0.0 when any alpha pays; None when none does (the ratio exceeds k + 1)."""
    if cost_ratio <= 1.0:
        return 0.0
    if cost_ratio > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_acceptance_length(mid, k) < cost_ratio else (lo, mid)
    return (lo + hi) / 2


def _costs(step_costs, k: int, decode_step: float | None) -> dict:
    """A row's measured costs relative to one k = 0 decode step of the same batch size (and the
    two steps' mean seconds)."""
    verify, rounds = step_costs.mean("verify"), step_costs.counts["verify"]
    if k == 0 or not verify or not rounds or not decode_step:
        return {"draft_pass_over_step": None, "verify_over_step": None,
                "break_even_alpha": None, "verify_s": None, "decode_s": decode_step}
    draft = step_costs.seconds["draft"] / rounds  # drafting for one round: k MTP passes
    ratio = (verify + draft) / decode_step
    return {"draft_pass_over_step": draft / k / decode_step,
            "verify_over_step": verify / decode_step,
            "break_even_alpha": break_even_alpha(ratio, k), "verify_s": verify,
            "decode_s": decode_step}


def verify_cost_by_rows(rows: list[dict]) -> list[dict]:
    """The verify step's cost per number of rows it computes for each sequence (k + 1: the
    last accepted token and k drafts), per batch size: its mean seconds over every row of the
    report with that k (the verify step does not depend on the draft head or the acceptance),
    and that over the k = 0 decode step (one row per sequence). What decides whether
    speculation can pay on a machine: k + 1 rows must cost far less than k + 1 decode steps."""
    out = []
    for b in sorted({r["batch_size"] for r in rows}):
        for k in sorted({r["k"] for r in rows if r["batch_size"] == b and r["k"] > 0}):
            got = [r for r in rows if r["batch_size"] == b and r["k"] == k
                   and r.get("verify_s") is not None]
            if not got:
                continue
            n = [r["step_costs"]["verify_count"] for r in got]
            verify = sum(r["verify_s"] * c for r, c in zip(got, n, strict=True)) / sum(n)
            decode = got[0]["decode_s"]
            out.append({"batch_size": b, "k": k, "rows_per_sequence": k + 1,
                        "verify_ms": verify * 1e3, "decode_ms": decode * 1e3,
                        "verify_over_step": verify / decode})
    return out


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
    draft_vocabs: Sequence[int] = (0,),
    simulate_acceptance: Sequence[float] | None = None,
    num_prompts: int = 8,
    repeats: int = 1,
    cpu_time: bool = False,
    quantization: str | None = None,
    engine: dict | None = None,
    workload: str = "questions",
    context: int = 0,
    probe_acceptance: float = 1.0,
) -> dict:
    """Run every (batch size, draft head, alpha, k) on the same prompts -> report dict (also
    printed as a table and written to ``json_path`` when given).

    prompts: strings (the model needs a tokenizer) or token-id lists; default: ``num_prompts``
    chat-formatted generic questions, or random token ids for models without a chat template.
    For batch size b the prompts run in consecutive groups of b concurrent requests. ``quick``:
    4 prompts and at most 8 new tokens, for smoke tests on tiny models. ``draft_vocabs`` and
    ``simulate_acceptance``: see the module docstring (simulated acceptance needs greedy
    decoding). ``repeats``: every row runs that many times, alternated with the others, and
    reports the median tok/s. ``cpu_time``: time everything in this process's CPU seconds
    instead of wall seconds (with one thread, what the run takes on a machine it has to
    itself; on a shared one, wall time also counts the time other processes hold the core).
    ``engine``: further ``LLM`` keyword arguments (the command line's model options but those
    the benchmark sets itself: ``speculative_method`` picks the drafter, e.g. "ngram",
    ``speculative_adaptive`` lets each request choose k up to each row's). ``workload``:
    "questions" (the default prompts) or "copy" (``copy_workload``: outputs that repeat their
    prompts, where prompt lookup pays). ``context``: that many tokens (random ids) shared by
    every prompt before its own, decoding deep in a context: the prefix cache holds them (one
    prefill in the warm-up, which also caches every prompt, so that every timed run resumes
    each prompt from the same cached state). ``probe_acceptance``: with simulated acceptance, a
    draft through adaptive k's probe head is right with that fraction of alpha
    (``SimulatedDrafts.probe_factor``).

    With ``speculative_adaptive`` in ``engine`` the rows of k > 0 run at that fixed k (adaptive
    off) and one more row per head and alpha lets every request choose its k up to the largest
    (``adaptive`` in the row), so both are measured in one run.
    """
    if workload not in ("questions", "copy"):
        raise ValueError(f"workload must be 'questions' or 'copy', got {workload!r}")
    if not isinstance(context, int) or isinstance(context, bool) or context < 0:
        raise ValueError(f"context must be an integer >= 0, got {context!r}")
    from hybridrt.llm import LLM

    ks = sorted({int(k) for k in ks})
    batch_sizes = sorted({int(b) for b in batch_sizes})
    draft_vocabs = list(dict.fromkeys(int(n) for n in draft_vocabs))
    alphas = [None] if simulate_acceptance is None else [float(a) for a in simulate_acceptance]
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    if not ks or ks[0] < 0:
        raise ValueError(f"ks must be integers >= 0, got {ks}")
    if not batch_sizes or batch_sizes[0] <= 0:
        raise ValueError(f"batch sizes must be positive, got {batch_sizes}")
    if not draft_vocabs or min(draft_vocabs) < 0:
        raise ValueError(f"draft vocabulary sizes must be >= 0 (0: the full head), got "
                         f"{draft_vocabs}")
    if simulate_acceptance is not None:
        if not alphas or not all(0.0 <= a <= 1.0 for a in alphas):
            raise ValueError(f"simulated acceptance rates must be in [0, 1], got {alphas}")
        if temperature != 0.0:
            raise ValueError("simulated acceptance replays the greedy continuation: it needs "
                             "temperature 0")
        if ks[0] != 0:
            raise ValueError("simulated acceptance needs k = 0 among the ks (its reference run)")
    if not 0.0 <= probe_acceptance <= 1.0:
        raise ValueError(f"probe_acceptance must be in [0, 1], got {probe_acceptance!r}")
    if quick:
        max_tokens = min(max_tokens, 8)
    before_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    adaptive = bool((engine or {}).get("speculative_adaptive")) and max(ks) > 0
    # the load, the warm-up, then each run: (k = 0, then every head, alpha and k > 0) per batch
    blocks = len(draft_vocabs) * len(alphas)  # with adaptive k, each after a k = 0 run
    configs_per_batch = (blocks if adaptive and ks[0] == 0 else 1) + blocks * (
        sum(k > 0 for k in ks) + adaptive)
    pb = bar("spec", 2 + len(batch_sizes) * repeats * configs_per_batch, unit="run",
             enabled=verbose)
    step(pb, "loading")
    try:
        reduced = max(draft_vocabs) or None
        # no prefix cache without a context: every run of the same prompts starts cold, so
        # that rows do not depend on the order they ran in, and a simulated run follows its
        # reference run (a hit computes the prompt's last token in another step, which in half
        # precision can turn a near-tied greedy choice); with one, every run resumes alike
        llm = LLM(model, **(engine or {}), dtype=dtype, speculative_tokens=max(ks), threads=threads,
                  quantization=quantization, enable_prefix_caching=context > 0,
                  # with a context, room for its blocks twice (k = 0 requests and drafting
                  # ones hash their blocks apart: the MTP's KV) besides the batch; a cache of
                  # one max-length request per sequence evicted one for the other each run
                  max_num_seqs=max(batch_sizes) + (1 if context else 0),
                  max_model_len=_max_len_hint(model, 4096 + context),
                  draft_vocab_size=reduced if max(ks) > 0 else None)
        proposer = mtp_of(llm.engine.proposer)
        if simulate_acceptance is not None and proposer is None and max(ks) > 0:
            raise ValueError("simulated acceptance replaces the MTP's drafts: "
                             f"speculative_method {llm.engine.args.speculative_method!r} "
                             "has none")
        heads = {0: None}
        if reduced and proposer is not None:
            from hybridrt.specdec.mtp import DraftHead

            ids = proposer.draft_head.token_ids.tolist()
            heads.update({n: DraftHead(llm.model, ids[:n]) for n in draft_vocabs if n})
        if prompts is None and workload == "copy":
            prompts = copy_prompts(llm, n=4 if quick else num_prompts)
        elif prompts is None:
            prompts = default_prompts(llm, n=4 if quick else num_prompts)
        prompts = list(prompts)
        if quick:
            prompts = prompts[:4]
        if not prompts:
            raise ValueError("no prompts")
        if context:
            prompts = with_context(llm, prompts, context)
        longest = max(_prompt_len(llm, p) for p in prompts)
        need = longest + max_tokens + max(ks) + 1
        if need > llm.engine.engine_config.max_model_len:
            raise ValueError(f"prompts of {longest} tokens + {max_tokens} new tokens exceed "
                             f"max_model_len {llm.engine.engine_config.max_model_len}")
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                ignore_eos=ignore_eos, seed=0 if temperature > 0 else None)
        # warm-up at the largest batch with every head: a backend may make weight copies for
        # batched GEMMs at first use
        pb.update()
        step(pb, "warm-up")
        warm = params.clone(max_tokens=3)
        if context:  # the shared context once, then every prompt cached behind it
            llm.generate(prompts[:1], warm, use_tqdm=False, speculative_tokens=0)
            llm.generate(prompts, warm, use_tqdm=False, speculative_tokens=0)
        for n in draft_vocabs if max(ks) > 0 else [0]:
            if proposer is not None:
                proposer.draft_head = heads[n]
            for k in ks:  # with a context, every prompt: drafting requests' blocks hash
                # apart (their MTP KV), and a first timed run that missed them would prefill
                # its prompt's own tokens deep in the context again
                llm.generate(prompts if context else prompts[:max(batch_sizes)], warm,
                             use_tqdm=False, speculative_tokens=k)

        clock = time.process_time if cpu_time else time.perf_counter

        def run(b: int, k: int, adapt: bool):
            if adaptive:
                llm.engine.proposer.adaptive = adapt
            outs, seconds = [], 0.0
            costs = llm.engine.step_costs = StepCosts(clock)  # this run's steps only
            for i in range(0, len(prompts), b):
                group = prompts[i:i + b]
                t = clock()
                res = llm.generate(group, params, use_tqdm=False, speculative_tokens=k)
                seconds += clock() - t
                for o in res:
                    if o.error is not None:
                        raise o.error
                outs.extend(res)
            llm.engine.step_costs = StepCosts()
            return outs, seconds, costs

        pb.update()
        rows = []
        for b in batch_sizes:
            refs: dict[int, dict[tuple, list[int]]] = {}  # per k: prompt -> greedy sequence
            configs = [(0, None, ks[0], False)] + [
                (n, a, k, adapt) for n in draft_vocabs for a in alphas
                for k, adapt in [(k, False) for k in ks if k > 0] + [(max(ks), True)] * adaptive]
            runs: dict[tuple, list] = {c: [] for c in configs}
            order = configs
            if adaptive and ks[0] == 0:  # a k = 0 run before each alpha's rows (``_summary``)
                size = (len(configs) - 1) // blocks
                order = [c for i in range(1, len(configs), size)  # the adaptive row first
                         for c in [configs[0], configs[i + size - 1], *configs[i:i + size - 1]]]
            k0_rate = None
            for rep in range(repeats):  # alternated, so that load changes hit every row alike
                for n, alpha, k, adapt in order:
                    sim = None
                    if alpha is not None and not adapt and k not in refs:
                        refs[k] = reference_run(llm, prompts, params, b, k, refs[0])
                    if proposer is not None:
                        proposer.draft_head = heads[n]
                        if alpha is not None:  # adaptive k mostly decodes: k = 0's sequences
                            sim = SimulatedDrafts(refs[0 if adapt else k], alpha,
                                                  llm.config.vocab_size, seed=rep,
                                                  probe_factor=probe_acceptance)
                    label = f"batch {b} k {'<=' if adapt else ''}{k}"
                    step(pb, label)
                    with drafts_through(llm, sim):
                        outs, seconds, costs = run(b, k, adapt)
                    pb.update()
                    refs.setdefault(0, sequences(outs))
                    rate = sum(len(o.outputs[0].token_ids) for o in outs) / seconds
                    paired_with = None if (n, alpha, k, adapt) == configs[0] else k0_rate
                    runs[(n, alpha, k, adapt)].append((outs, seconds, costs, sim, paired_with))
                    if (n, alpha, k, adapt) == configs[0]:
                        k0_rate = rate
                    if verbose:
                        what = "" if k == 0 else (f" head {n or 'full'}" + (
                            "" if alpha is None else f" simulated alpha {alpha}"))
                        pb.write(f"{label}{what}: {rate:.1f} tok/s", file=sys.stderr)
            base = _summary(runs[configs[0]])
            for n, alpha, k, adapt in configs:
                got = _summary(runs[(n, alpha, k, adapt)])
                outs, sim = got["outs"], got["sim"]
                rows.append({
                    "batch_size": b,
                    "k": k,
                    "adaptive": adapt,
                    "context": context,
                    "draft_vocab": n if k > 0 and proposer is not None else None,
                    "acceptance": "real" if alpha is None else "simulated",
                    "simulated_alpha": alpha if k > 0 else None,
                    "num_requests": len(outs),
                    "generated_tokens": got["tokens"],
                    "seconds": got["seconds"],
                    "tok_s": got["tok_s"],
                    "tok_s_runs": got["tok_s_runs"],
                    "speedup": (None if ks[0] != 0 or not base["tok_s"] else 1.0 if k == 0
                                else got["paired"] if got["paired"] is not None
                                else got["tok_s"] / base["tok_s"]),
                    **_spec_summary(got["all_outs"], k),
                    "expected_acceptance_length": (
                        expected_acceptance_length(alpha, k) if sim is not None else None),
                    "reference_coverage": sim.coverage if sim is not None else None,
                    **_costs(got["costs"], k, base["costs"].mean("decode")),
                    "step_costs": got["costs"].as_dict(),
                    "identical_to_k0": (got["token_ids"] == base["token_ids"]) if ks[0] == 0
                    else None,
                })
        if proposer is not None:
            proposer.draft_head = heads[reduced or 0]
        if adaptive:
            llm.engine.proposer.adaptive = True
        report = {
            "model": str(model),
            "dtype": str(dtype),
            "threads": threads,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "num_prompts": len(prompts),
            "repeats": repeats,
            "clock": "cpu" if cpu_time else "wall",
            "ks": ks,
            "batch_sizes": batch_sizes,
            "draft_vocabs": draft_vocabs,
            "draft_vocab_source": llm.draft_vocab_source,
            "acceptance": "real" if simulate_acceptance is None else "simulated",
            "workload": workload,
            "context": context,
            "speculative_method": llm.engine.args.speculative_method,
            "speculative_adaptive": llm.engine.args.speculative_adaptive,
            "simulated_alphas": None if simulate_acceptance is None else alphas,
            "probe_acceptance": probe_acceptance,
            "rows": rows,
            "verify_cost": verify_cost_by_rows(rows),
        }
    finally:
        pb.close()
        torch.set_num_threads(before_threads)
    if verbose:
        print(format_table(report))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=2))
        if verbose:
            print(f"wrote {json_path}", file=sys.stderr)
    return report


def with_context(llm, prompts: Sequence, context: int, seed: int = 1) -> list[list[int]]:
    """Every prompt as token ids behind the same ``context`` random ids."""
    g = torch.Generator().manual_seed(seed)
    vocab = llm.config.vocab_size
    shared = torch.randint(min(3, vocab - 1), vocab, (context,), generator=g).tolist()
    return [shared + (llm.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str)
                      else list(p)) for p in prompts]


def _max_len_hint(model, cap: int) -> int:
    """max_model_len for the benchmark LLM: the model's max positions, capped."""
    from hybridrt.loader import load_config, resolve_model_path

    cfg = load_config(resolve_model_path(model))
    return min(cfg.max_position_embeddings, cap)
