"""Throughput benchmark: hybridrt vs transformers ``generate`` on the same weights, one run
(``hybridrt bench throughput``).

Reports prefill tok/s (one 512-token prompt), decode tok/s at batch 1, and for 8 and 32
concurrent requests the aggregate output tok/s (wall time of the whole batch, its prefill
included) and the aggregate decode tok/s (prefill excluded, like the batch-1 figure), for both
engines, and the ratios; with ``interleave``, the batching ratio once more from batch-1 and
32-request runs alternated three times. The printed report: hybridrt.bench.throughput_report.
Both engines get the same prompts and generate the same number of new
tokens in every row; ``work`` in the report records, per row and engine, the requests, prompt
length and new tokens per request that were actually run. Timings on shared machines are noisy:
read the ratios, measured side by side in the same process.

With ``against_llamacpp`` (a GGUF of the same model, or several: e.g. Q4_K_M and Q4_0),
llama.cpp's own benchmarks run the same work with the same threads (hybridrt.bench.llamacpp), in
rounds alternated with hybridrt's (each GGUF in turn within a llama.cpp round), and the report
adds their figures and hybridrt's ratios to them. Every run also measures what the machine
allows (hybridrt.bench.ceilings): the read bandwidth, an fp32 matmul rate, and the batch-1 decode
ceiling, bandwidth over the bytes of weights a decode step reads.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridrt.bench.llamacpp import DEFAULT_ORDER, ENGINES, check_order
from hybridrt.bench.throughput_report import format_table
from hybridrt.sampling_params import SamplingParams


def _restores_threads(fn):
    """Run ``fn`` (which sets torch's thread count) and put the caller's count back."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)

    return wrapper


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def make_random_08b(directory: str | Path, seed: int = 0) -> Path:
    from hybridrt.bench.fixtures import QWEN35_08B_TEXT_CONFIG, write_random_checkpoint

    return write_random_checkpoint(directory, QWEN35_08B_TEXT_CONFIG, seed=seed,
                                   dtype=torch.bfloat16)


def _work(requests: int, prompt_len: int, new_tokens: list[int]) -> dict:
    """What one measured run did; ``new_tokens`` per request, which must all be equal."""
    if len(set(new_tokens)) != 1 or len(new_tokens) != requests:
        raise RuntimeError(f"{requests} requests generated {new_tokens} new tokens")
    return {"requests": requests, "prompt_len": prompt_len, "new_tokens": new_tokens[0]}


def cache_budget(model: str | Path, dtype: str, max_len: int, max_seqs: int, tokens: int) -> int:
    """Bytes of cache for ``bench_ours``' work, as llama.cpp's ``-c`` holds its: a state slot
    per sequence (and the null slot), KV blocks for ``tokens`` positions in all (plus a partly
    filled block per sequence) and never fewer than one ``max_len`` sequence needs. A larger
    budget (a fraction of free memory) would add untouched-then-zeroed KV blocks to the peak
    RSS compared with llama.cpp's."""
    from hybridrt.llm import default_model
    from hybridrt.loader import load_config, parse_dtype, resolve_model_path
    from hybridrt.statecache import CacheTensors

    config = load_config(resolve_model_path(model or default_model()))
    dt = torch.bfloat16 if dtype == "auto" else parse_dtype(dtype)
    block = 16
    blocks = max(-(-tokens // block) + max_seqs, -(-max_len // block))
    return ((max_seqs + 1) * CacheTensors.bytes_per_slot(config, dt)
            + blocks * CacheTensors.bytes_per_block(config, block, dt))


def load_ours(model: str | Path, dtype: str, prefill_len: int, decode_tokens: int,
              concurrency: list[int], prompt_len: int, quantization: str | None = None,
              batch_invariant: bool = False, engine: dict | None = None):
    """The engine for ``bench_ours``, warmed up; its cache sized for the work
    (``cache_budget``), without session snapshot slots."""
    from hybridrt.bench.llamacpp import context_size
    from hybridrt.llm import LLM

    max_len = max(prefill_len, prompt_len) + decode_tokens + 8
    seqs = max(concurrency + [1])
    tokens = max(context_size(prompt_len, decode_tokens, concurrency or [1]), max_len)
    llm = LLM(model, **(engine or {}), dtype=dtype, max_model_len=max_len, max_num_seqs=seqs,
              threads=torch.get_num_threads(),  # the benchmark's, fixed
              max_num_batched_tokens=max(prefill_len, 512), max_num_sessions=0,
              cache_memory=cache_budget(model, dtype, max_len, seqs, tokens),
              quantization=quantization, batch_invariant=batch_invariant)
    if llm.cache_sizing.max_num_seqs < seqs:
        raise RuntimeError(f"the benchmark's cache holds too little: "
                           f"{llm.cache_sizing.describe()}")
    # warm-up with the largest batch of the measured shape: the first step of a shape faults in
    # its buffers' pages
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(_prompts(max(concurrency + [1]), prompt_len, llm.config.vocab_size, 99), warm,
                 use_tqdm=False)
    return llm


def _no_tick() -> None:
    pass


def our_runs(repeats: int, concurrency: list[int], interleave: bool) -> int:
    """How many runs ``bench_ours`` measures (its ``tick`` calls)."""
    return repeats + max(repeats, 5) + len(concurrency) + (6 if concurrency and interleave else 0)


def transformers_runs(repeats: int, concurrency: list[int]) -> int:
    """How many ``generate`` calls ``bench_transformers`` makes (its ``tick`` calls)."""
    return 1 + 3 * repeats + 2 * len(concurrency)


def bench_ours(llm, prefill_len: int, decode_tokens: int, concurrency: list[int],
               prompt_len: int, repeats: int, interleave: bool = True,
               read=None, b1_pairs: list | None = None, tick=None) -> tuple[dict, dict]:
    """One round of hybridrt's measurements -> (results, the work of each row); with
    ``interleave``, also the batching ratio from alternated runs. ``read``: a callable giving
    the read bandwidth (GB/s), run just before each batch-1 run and once after the last, each
    run's (tok/s, GB/s before it, GB/s after it) appended to ``b1_pairs`` (a run's "after" is
    the next run's "before"). ``tick``: called after each measured run (``our_runs`` of
    them)."""
    tick = tick or _no_tick
    vocab = llm.config.vocab_size
    res: dict[str, float] = {}
    work: dict[str, dict] = {}
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(repeats):
        p = _prompts(1, prefill_len, vocab, 100 + r)
        t = time.perf_counter()
        outs = llm.generate(p, one, use_tqdm=False)
        times.append(time.perf_counter() - t)
        tick()
    res["prefill_tok_s"] = prefill_len / statistics.median(times)
    work["prefill_tok_s"] = _work(1, prefill_len, [len(o.outputs[0].token_ids) for o in outs])

    sp = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    rates, reads = [], []
    # batch 1 is the denominator of the batching ratios and a short run: at least five runs,
    # so that one noisy stretch of a shared machine does not move the median
    for r in range(max(repeats, 5)):
        if read is not None:
            reads.append(read())
        (out,) = llm.generate(_prompts(1, prompt_len, vocab, 200 + r), sp, use_tqdm=False)
        rates.append(out.metrics["decode_tokens_per_s"])
        tick()
    if read is not None and b1_pairs is not None:
        reads.append(read())  # after the last run
        b1_pairs.extend(zip(rates, reads, reads[1:]))
    res["decode_b1_tok_s"] = statistics.median(rates)
    work["decode_b1_tok_s"] = _work(1, prompt_len, [len(out.outputs[0].token_ids)])

    for c in concurrency:
        prompts = _prompts(c, prompt_len, vocab, 300 + c)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        tick()
        res[f"aggregate_b{c}_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
        # the c requests decode side by side: the sum of their decode rates is the decode
        # throughput at c concurrent (prefill excluded, as in decode_b1_tok_s)
        res[f"decode_b{c}_tok_s"] = sum(o.metrics["decode_tokens_per_s"] for o in outs)
        work[f"aggregate_b{c}_tok_s"] = work[f"decode_b{c}_tok_s"] = _work(
            c, prompt_len, [len(o.outputs[0].token_ids) for o in outs])
    if concurrency and interleave:
        # the batching ratio again from batch-1 and largest-batch runs alternated, so that drift
        # in a shared machine's speed between the measurements above does not enter it
        c = max(concurrency)
        alone, batched = [], []
        for r in range(3):
            (out,) = llm.generate(_prompts(1, prompt_len, vocab, 400 + r), sp, use_tqdm=False)
            alone.append(out.metrics["decode_tokens_per_s"])
            outs = llm.generate(_prompts(c, prompt_len, vocab, 500 + r), sp, use_tqdm=False)
            batched.append(sum(o.metrics["decode_tokens_per_s"] for o in outs))
            tick()
        res[f"interleaved_decode_b{c}_over_b1"] = (statistics.median(batched)
                                                   / statistics.median(alone))
    return res, work


def bench_transformers(state_dict: dict, text_config: dict, dtype: torch.dtype, prefill_len: int,
                       decode_tokens: int, concurrency: list[int], prompt_len: int,
                       repeats: int, vocab: int, tick=None) -> tuple[dict, dict]:
    """transformers ``generate`` on the same work -> (results, the work of each row);
    ``tick`` called after each measurement (``transformers_runs`` of them)."""
    from hybridrt.bench.fixtures import hf_reference_model

    tick = tick or _no_tick

    ref = hf_reference_model(text_config, state_dict, dtype=dtype)
    gen = {"do_sample": False, "pad_token_id": 0}
    work: dict[str, dict] = {}

    def run(ids: list[list[int]], n: int, row: str | None = None) -> float:
        x = torch.tensor(ids)
        t = time.perf_counter()
        with torch.inference_mode():
            out = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                               min_new_tokens=n, **gen)
        dt = time.perf_counter() - t
        tick()
        if row is not None:
            work[row] = _work(len(ids), x.shape[1], [out.shape[1] - x.shape[1]] * len(ids))
        return dt

    res: dict[str, float] = {}
    run(_prompts(1, 8, vocab, 99), 2)
    res["prefill_tok_s"] = prefill_len / statistics.median(
        run(_prompts(1, prefill_len, vocab, 100 + r), 1, "prefill_tok_s") for r in range(repeats)
    )
    rates = []
    for r in range(repeats):
        p = _prompts(1, prompt_len, vocab, 200 + r)
        t1 = run(p, 1)
        tn = run(p, decode_tokens, "decode_b1_tok_s")
        rates.append((decode_tokens - 1) / max(tn - t1, 1e-9))
    res["decode_b1_tok_s"] = statistics.median(rates)
    for c in concurrency:
        p = _prompts(c, prompt_len, vocab, 300 + c)
        dt = run(p, decode_tokens, f"aggregate_b{c}_tok_s")
        work[f"decode_b{c}_tok_s"] = work[f"aggregate_b{c}_tok_s"]
        res[f"aggregate_b{c}_tok_s"] = c * decode_tokens / dt
        res[f"decode_b{c}_tok_s"] = c * (decode_tokens - 1) / max(dt - run(p, 1), 1e-9)
    return res, work


STEADY = 0.10  # a batch-1 run whose read loops before and after differ by at most this share


def steady_runs(pairs: list, per_token: int, tolerance: float = STEADY) -> list[dict]:
    """The batch-1 runs during which the machine's read bandwidth held still: of ``pairs``
    (tok/s, GB/s read before the run, GB/s read after it), those whose two reads differ by at
    most ``tolerance`` of the first, each with its fraction of the ceiling against the mean of
    its two reads, sorted by that read. (This machine's read moves between levels from one read
    to the next; a run whose reads disagree may have run at either.)"""
    out = []
    for rate, before, after in pairs:
        if abs(after - before) <= tolerance * before:
            read = (before + after) / 2
            out.append({"tok_s": rate, "read_gb_s": read,
                        "fraction": rate * per_token / (read * 1e9)})
    return sorted(out, key=lambda r: r["read_gb_s"])


def _medians(rounds: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def _check_same_work(ours: dict, theirs: dict) -> None:
    """llama.cpp's rows against ours: the same prompt length for prefill (llama-bench generates
    no token there), the same new tokens at batch 1 (its tg runs without a prompt), everything
    the same at each concurrency."""
    fields = {"prefill_tok_s": ("requests", "prompt_len"),
              "decode_b1_tok_s": ("requests", "new_tokens")}
    for row, w in theirs.items():
        keys = fields.get(row, ("requests", "prompt_len", "new_tokens"))
        if any(w[k] != ours[row][k] for k in keys):
            raise RuntimeError(f"unequal work in {row}: hybridrt {ours[row]}, llama.cpp {w}")


@_restores_threads
def throughput(model: str | None = None, dtype: str = "bfloat16", threads: int = 2,
               prefill_len: int = 512, prompt_len: int = 16, decode_tokens: int = 16,
               concurrency: list[int] = (8, 32), repeats: int = 2, transformers: bool = True,
               json_path: str | Path | None = None,
               against_llamacpp: str | Path | list[str | Path] | None = None,
               llamacpp_bin: str | Path | None = None, order: list[str] = DEFAULT_ORDER,
               stream_bytes: int = 1 << 30, quantization: str | None = None,
               batch_invariant: bool = False, engine: dict | None = None,
               interleave: bool = True) -> dict:
    """Run the throughput benchmark -> the report (also printed as a table and written to
    ``json_path``). ``model``: a checkpoint (default: a random-weight 0.8B-shaped one).
    ``against_llamacpp``: a GGUF of the same model (or a list of them), benchmarked by llama.cpp
    in the rounds ``order`` names (hybridrt's rows measured once per ``hybridrt`` round, every
    GGUF once per ``llamacpp`` round); each engine's figure is the median over its rounds. The
    first GGUF's figures are ``llamacpp`` in the report, the others' ``llamacpp_others`` (by
    file name). The read bandwidth (``stream_bytes`` streamed) and
    an fp32 matmul rate are measured in the same run, with the same threads.
    ``quantization``: hybridrt's weights in int8 or int4; transformers (unquantized) is left
    out. ``batch_invariant``: hybridrt in its batch-invariant mode (docs/batch_invariance.md).
    ``engine``: further ``LLM`` keyword arguments (the command line's model options but those
    the benchmark sets itself). ``interleave``: also the batching ratio from batch-1 and
    largest-batch runs alternated three times. What it will run and a progress bar over its
    steps go to stderr before the first of them."""
    from tqdm import tqdm

    from hybridrt.bench import ceilings, llamacpp

    ggufs = ([] if not against_llamacpp else [against_llamacpp]
             if isinstance(against_llamacpp, (str, Path)) else list(against_llamacpp))
    bins = None
    for g in ggufs:
        bins = llamacpp.check(g, llamacpp_bin)
    labels = _labels(ggufs)
    order = check_order(order) if bins is not None else ["hybridrt"]
    torch.set_num_threads(threads)
    concurrency = list(concurrency)
    if quantization:
        transformers = False
    print(plan(prefill_len, prompt_len, decode_tokens, concurrency, repeats, threads, order,
               transformers, interleave, model is None), file=sys.stderr, flush=True)
    steps = (2 + (model is None) + (transformers_runs(repeats, concurrency) if transformers else 0)
             + sum(our_runs(repeats, concurrency, interleave and i == 0) if e == "hybridrt"
                   else len(ggufs) for i, e in enumerate(order)))
    bar = tqdm(total=steps, desc="throughput", unit="step", file=sys.stderr, mininterval=0.5)
    tick = functools.partial(bar.update, 1)
    tmp = None
    path = model
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="hybridrt-08b-")
        bar.set_postfix_str("writing the random checkpoint")
        path = str(make_random_08b(tmp.name))
        tick()
    load_start = list(os.getloadavg())
    bar.set_postfix_str("loading hybridrt")
    llm = load_ours(path, dtype, prefill_len, decode_tokens, concurrency, prompt_len,
                    quantization, batch_invariant, engine)
    tick()
    rounds, our_work, their_work, their_run = [], None, {}, {}
    def read_gb_s() -> float:  # the read loop just before a round: its own ceiling
        return ceilings.stream_read_apart(threads, stream_bytes)

    for engine in order:
        load = list(os.getloadavg())
        if engine == "hybridrt":
            read, pairs = read_gb_s(), []
            bar.set_postfix_str("hybridrt")
            res, our_work = bench_ours(llm, prefill_len, decode_tokens, concurrency, prompt_len,
                                       repeats, interleave=interleave and not rounds,
                                       read=read_gb_s, b1_pairs=pairs, tick=tick)
        else:
            for gguf, label in zip(ggufs, labels):
                load = list(os.getloadavg())
                bar.set_postfix_str(f"llama.cpp {label}")
                read = read_gb_s()
                res, their_work[label], their_run[label] = llamacpp.bench(
                    gguf, bins, threads, prefill_len, prompt_len, decode_tokens, concurrency)
                tick()
                rounds.append({"engine": engine, "gguf": label, "load_average": load,
                               "read_gb_s": read, "results": res})
            continue
        rounds.append({"engine": engine, "load_average": load, "read_gb_s": read,
                       "b1_pairs": pairs, "results": res})
    interleaved = {k: rounds[0]["results"].pop(k) for k in list(rounds[0]["results"])
                   if k.startswith("interleaved_")}
    ours = _medians([r["results"] for r in rounds if r["engine"] == "hybridrt"])
    c = max(concurrency, default=None)
    report = {"model": str(model or "random Qwen3.5-0.8B shape"), "dtype": dtype,
              "quantization": quantization, "batch_invariant": batch_invariant,
              "threads": threads, "cpu": ceilings.cpu_info(),
              "workload": {"prefill_len": prefill_len, "prompt_len": prompt_len,
                           "decode_tokens": decode_tokens, "concurrency": concurrency,
                           "repeats": repeats},
              "hybridrt": ours, "work": {"hybridrt": our_work}, **interleaved,
              "peak_rss_gib": _peak_rss_gib(),
              "load_average": {"start": load_start}}
    if c is not None:
        report[f"ratio_aggregate_b{c}_vs_b1"] = (ours[f"aggregate_b{c}_tok_s"]
                                                 / ours["decode_b1_tok_s"])
        report[f"ratio_decode_b{c}_vs_b1"] = ours[f"decode_b{c}_tok_s"] / ours["decode_b1_tok_s"]
    if bins is not None:
        for label in labels:
            _check_same_work(our_work, their_work[label])
        for i, (gguf, label) in enumerate(zip(ggufs, labels)):
            theirs = _medians([r["results"] for r in rounds
                               if r["engine"] == "llamacpp" and r["gguf"] == label])
            run = {"gguf": str(gguf), "bin": str(bins), **their_run[label],
                   "prompts": "llama.cpp's own random tokens; llama-bench's tg runs without a "
                              "prompt"}
            if i == 0:
                report["llamacpp"] = theirs
                report["work"]["llamacpp"] = their_work[label]
                report["ratio_vs_llamacpp"] = llamacpp.ratios(ours, theirs)
                report["llamacpp_run"] = run
            else:
                report.setdefault("llamacpp_others", {})[label] = {
                    "results": theirs, "ratio": llamacpp.ratios(ours, theirs), "run": run}
        report["rounds"] = rounds
    bar.set_postfix_str("read bandwidth, fp32 matmul")
    stream = ceilings.stream_read(threads, stream_bytes)
    per_token = ceilings.weight_bytes_per_token(llm.model)
    state = ceilings.state_bytes_per_token(llm.engine.cache.tensors)
    ceiling = stream["gb_s"] * 1e9 / per_token
    matmul = ceilings.matmul_rate(threads)
    tick()
    report["ceilings"] = {
        "stream_read": stream, "matmul_fp32": matmul,
        "weight_bytes_per_token": per_token, "state_bytes_per_token": state,
        "batch1_decode_tok_s": ceiling,
        "fraction": {e: report[e]["decode_b1_tok_s"] / ceiling
                     for e in ENGINES if e in report}}
    for label, other in report.get("llamacpp_others", {}).items():
        report["ceilings"]["fraction"][f"llamacpp {label}"] = (
            other["results"]["decode_b1_tok_s"] / ceiling)
    by_round: dict[str, list[float]] = {}  # each round against the read loop just before it
    for r in rounds:
        name = "hybridrt" if r["engine"] == "hybridrt" else f"llama.cpp {r['gguf']}"
        by_round.setdefault(name, []).append(
            r["results"]["decode_b1_tok_s"] * per_token / (r["read_gb_s"] * 1e9))
    report["ceilings"]["fraction_by_round"] = by_round
    report["ceilings"]["read_gb_s_by_round"] = [r["read_gb_s"] for r in rounds]
    # each batch-1 run of ours against the read loop run just before it
    pairs = [p for r in rounds for p in r.get("b1_pairs", [])]
    runs = [rate * per_token / (gb_s * 1e9) for rate, gb_s, _ in pairs]
    if runs:
        report["ceilings"]["fraction_by_run"] = runs
        report["ceilings"]["steady_runs"] = steady_runs(pairs, per_token)
    if transformers:
        import copy
        import json as _json

        cfg_path = Path(llm.model_path) / "config.json"
        raw = _json.loads(cfg_path.read_text())
        text_cfg = copy.deepcopy(raw.get("text_config", raw))
        text_cfg.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", True))
        sd = dict(llm.model.state_dict())
        sd = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
        vocab = llm.config.vocab_size
        del llm
        gc.collect()
        bar.set_postfix_str("transformers")
        theirs, their_work = bench_transformers(
            sd, text_cfg, torch.bfloat16 if dtype.startswith("b") else torch.float32,
            prefill_len, decode_tokens, concurrency, prompt_len, repeats, vocab, tick=tick)
        if their_work != our_work:
            raise RuntimeError(f"unequal work: hybridrt {our_work}, transformers {their_work}")
        report["transformers"] = theirs
        report["work"]["transformers"] = their_work
        report["ratio_vs_transformers"] = {k: ours[k] / theirs[k] for k in ours if k in theirs}
    report["load_average"]["end"] = list(os.getloadavg())
    bar.close()
    if tmp is not None:
        tmp.cleanup()
    print(format_table(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}", file=sys.stderr)
    return report


def plan(prefill_len: int, prompt_len: int, decode_tokens: int, concurrency: list[int],
         repeats: int, threads: int, order: list[str], transformers: bool, interleave: bool,
         random_model: bool) -> str:
    """The one line saying what ``throughput`` will run, printed before it runs anything."""
    parts = [f"prefill of a {prefill_len}-token prompt",
             f"decode of {decode_tokens} tokens at batch 1"
             + "".join(f", {c}" for c in concurrency) + f" ({prompt_len}-token prompts)",
             f"median of {repeats} run{'s' if repeats > 1 else ''} (batch 1: of "
             f"{max(repeats, 5)})", f"{threads} threads"]
    if interleave and concurrency:
        parts.append(f"batch 1 and {max(concurrency)} alternated 3 times")
    engines = ["hybridrt"] + (["llama.cpp"] if "llamacpp" in order else []) + (
        ["transformers"] if transformers else [])
    model = "a random-weight Qwen3.5-0.8B-shaped checkpoint, " if random_model else ""
    return (f"bench throughput: {model}{', '.join(engines)}; " + "; ".join(parts)
            + (f"; rounds {','.join(order)}" if len(order) > 1 else ""))


def _labels(ggufs: list) -> list[str]:
    """Each GGUF's name in the report: its file name without .gguf (numbered when two agree)."""
    names = [Path(g).name.removesuffix(".gguf") for g in ggufs]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


def _peak_rss_gib() -> float | None:
    """This process's peak resident memory so far (weights, their CPU GEMM copies, caches)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)
