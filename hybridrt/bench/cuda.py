"""GPU benchmark: hybridrt's CUDA backend against transformers on the same GPU.

The Qwen3.5-0.8B shape with random bf16 weights (written to a temporary directory unless
``--model`` names a checkpoint). Reported, all from one run:

- ``roofline``: device copy bandwidth (bytes read + written per second) and the batch-1 decode
  ceiling it implies, bandwidth / bytes of weights read per step;
- ``ours``: decode tok/s at each batch size (every request decodes ``--decode-tokens`` tokens
  after a ``--prompt-len`` prompt; prefill excluded: the clock starts once every request has
  its first token), with ``async_scheduling`` as the engine has it (on for CUDA) and, at the
  ``--phase-batches`` sizes, without it (``decode_b1_sync_tok_s``); prefill tok/s of one
  prompt of each ``--prefill`` length (time to first token);
- ``transformers``: the same figures for ``Qwen3_5ForCausalLM.generate`` (fla kernels when
  fla is installed), decode from the difference of an n-token and a 1-token generate;
- ``phases``: where a decode step's time goes at each of ``--phase-batches``: the engine's
  step cut into the phases it reports to its observer (``LLMEngine.observer``: schedule /
  prepare / forward / logits / sample / update), the device synchronised at every cut
  (``PhaseTimer``), so each phase holds its own device work (microseconds per step; ``sum``
  against ``step``, the same steps unsynchronised, shows how much the cuts cost);
- ``profile``: ``torch.profiler`` over ``--profile-steps`` decode steps at batch 1 and one
  prefill of the first ``--prefill`` length: kernel launches and device / host time per step,
  and the ops with the most device time (host time on CPU).

``python -m hybridrt.bench.cuda --json out.json`` (``--help`` for the options).
``--device cpu --tiny`` runs every part on a tiny random model on the CPU: a dry run of the
benchmark's code (tests/test_cudabench.py), not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def copy_bandwidth(nbytes: int = 4 << 30, repeats: int = 10, device: str = "cuda") -> float:
    """Device-to-device copy, bytes read + written per second (median of ``repeats``)."""
    x = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        y.copy_(x)
        _sync()
        times.append(time.perf_counter() - t)
    del x, y
    return 2 * nbytes / statistics.median(times)


def decode_rate(engine, prompts, params) -> float:
    """Decode tok/s of ``prompts`` run together: the clock starts once each has its first
    token."""
    ids = [engine.add_request(p, params) for p in prompts]
    reqs = [engine.get_request(i) for i in ids]
    while any(r.num_output_tokens < 1 for r in reqs):
        engine.step()
    _sync()
    start_tokens = sum(r.num_output_tokens for r in reqs)
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    _sync()
    dt = time.perf_counter() - t
    tokens = sum(r.num_output_tokens for r in reqs) - start_tokens
    for i in ids:
        engine.pop_request(i)
    return tokens / dt


def prefill_rate(engine, prompt, repeats: int = 3) -> float:
    from hybridrt.sampling_params import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        rid = engine.add_request(prompt, one)
        while engine.has_unfinished_requests():
            engine.step()
        _sync()
        times.append(time.perf_counter() - t)
        engine.pop_request(rid)
    return len(prompt) / statistics.median(times)


PHASES = ("schedule", "prepare", "forward", "logits", "sample", "update")


class PhaseTimer:
    """An engine observer (``LLMEngine.observer``): ``phase(name)`` synchronises the device
    before and after the phase, so that the phase's own device work lands in it, and adds
    the time between to ``spent[name]`` (seconds; the engine's phases, ``PHASES``, from 0)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str):
        _sync()
        t0 = time.perf_counter()
        yield
        _sync()
        self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t0


def step_phases(engine, prompts, steps: int) -> dict:
    """Microseconds per decode step in each phase of ``engine.step`` (a ``PhaseTimer`` as the
    engine's observer: the device synchronised at every phase boundary) for ``prompts``
    decoding together; ``step``: the same number of steps unsynchronised, ``sum``: the
    phases' total."""
    from hybridrt.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    reqs = [engine.get_request(i) for i in ids]
    while any(r.num_output_tokens < 4 for r in reqs):
        engine.step()
    _sync()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    plain = (time.perf_counter() - t) / steps
    timer, before = PhaseTimer(), getattr(engine, "observer", None)
    engine.observer = timer
    try:
        for _ in range(steps):
            engine.step()
    finally:
        engine.observer = before
    spent = timer.spent
    assert all(r.num_output_tokens == 4 + 2 * steps for r in reqs), "requests ended early"
    for i in ids:
        engine.abort_request(i)
        engine.pop_request(i)
    res = {k: v / steps * 1e6 for k, v in spent.items()}
    res["sum"] = sum(spent.values()) / steps * 1e6
    res["step"] = plain * 1e6
    return res


def profile_summary(fn, steps: int, top: int = 15) -> dict:
    """``torch.profiler`` over ``fn()`` (``steps`` engine steps): per step, kernel launches and
    device / host time; the ``top`` ops by device time (by host time where there is no
    device)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        acts.append(ProfilerActivity.CUDA)
    _sync()
    with profile(activities=acts) as prof:
        fn()
        _sync()
    events = prof.key_averages()

    def dev(e):
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))

    kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA")]
    rows = sorted(events, key=lambda e: (dev(e), e.self_cpu_time_total), reverse=True)[:top]
    return {
        "steps": steps,
        "kernels_per_step": len(kernels) / steps,
        "device_us_per_step": sum(dev(e) for e in events) / steps,
        "host_us_per_step": sum(e.self_cpu_time_total for e in events) / steps,
        "top": [{"name": e.key[:80], "calls": e.count, "device_us": dev(e),
                 "host_us": e.self_cpu_time_total} for e in rows],
    }


def profile_ours(engine, args, vocab: int) -> dict:
    from hybridrt.sampling_params import SamplingParams

    steps = args.profile_steps
    sp = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    rid = engine.add_request(_prompts(1, args.prompt_len, vocab, 7)[0], sp)
    while engine.get_request(rid).num_output_tokens < 2:
        engine.step()

    def decode():
        for _ in range(steps):
            engine.step()

    res = {"decode_b1": profile_summary(decode, steps)}
    engine.abort_request(rid)
    engine.pop_request(rid)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    n = args.prefill[0]
    prompt = _prompts(1, n, vocab, 8)[0]

    def prefill():
        rid = engine.add_request(prompt, one)
        while engine.has_unfinished_requests():
            engine.step()
        engine.pop_request(rid)

    res[f"prefill_{n}"] = profile_summary(prefill, 1)
    return res


def bench_ours(model_dir, args) -> dict:
    from hybridrt.llm import LLM
    from hybridrt.sampling_params import SamplingParams

    max_len = max(max(args.prefill), args.prompt_len + args.decode_tokens) + 16
    t = time.perf_counter()
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, backend=args.backend,
              max_model_len=max_len, max_num_seqs=max(args.batches),
              max_num_batched_tokens=max(args.prefill), cache_memory=args.cache_memory,
              tokenizer=None, async_scheduling={"on": True, "off": False, None: None}[
                  args.async_scheduling])
    _sync()
    res: dict = {"load_s": time.perf_counter() - t, "backend": llm.engine.runner.backend.name}
    eng = llm.engine
    vocab = llm.config.vocab_size
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    t = time.perf_counter()
    for b in args.batches:  # compiles the kernels and captures the graphs
        decode_rate(eng, _prompts(b, args.prompt_len, vocab, 1), warm)
    for n in args.prefill:
        prefill_rate(eng, _prompts(1, n, vocab, 2)[0], repeats=1)
    res["warmup_s"] = time.perf_counter() - t
    sp = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    for b in args.batches:
        rates = [decode_rate(eng, _prompts(b, args.prompt_len, vocab, 10 + r), sp)
                 for r in range(args.repeats if b <= 32 else 1)]
        res[f"decode_b{b}_tok_s"] = statistics.median(rates)
    res["async_scheduling"] = eng.async_scheduling
    if eng.async_scheduling:  # the same without it, at the phase breakdown's batch sizes
        eng.async_scheduling = False
        for b in args.phase_batches:
            res[f"decode_b{b}_sync_tok_s"] = statistics.median(
                decode_rate(eng, _prompts(b, args.prompt_len, vocab, 10 + r), sp)
                for r in range(args.repeats if b <= 32 else 1))
        eng.async_scheduling = True
    for n in args.prefill:
        res[f"prefill_{n}_tok_s"] = prefill_rate(eng, _prompts(1, n, vocab, 3)[0])
    res["phases"] = {
        f"b{b}": step_phases(eng, _prompts(b, args.prompt_len, vocab, 5), args.phase_steps)
        for b in args.phase_batches}
    if args.profile_steps:
        res["profile"] = profile_ours(eng, args, vocab)
    res["num_graphs"] = len(getattr(eng.runner.backend, "graphs", {}))
    res["num_chained_steps"] = eng.stats["num_chained_steps"]
    weights = sum(p.numel() * p.element_size() for n, p in llm.model.named_parameters()
                  if not n.startswith("mtp."))
    res["weight_bytes"] = weights
    del llm, eng
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return res


def bench_transformers(text_config, state_dict, args) -> dict:
    from hybridrt.bench.fixtures import hf_reference_model

    dtype = getattr(torch, args.dtype)
    ref = hf_reference_model(text_config, state_dict, dtype).to(args.device)
    vocab = text_config["vocab_size"]
    res: dict = {}
    try:
        import fla  # noqa: F401

        res["fla"] = True
    except ImportError:
        res["fla"] = False

    def run(ids, n):
        x = torch.tensor(ids, device=args.device)
        _sync()
        t = time.perf_counter()
        with torch.inference_mode():
            ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=0)
        _sync()
        return time.perf_counter() - t

    run(_prompts(1, 16, vocab, 99), 4)
    for b in args.batches:
        if b > args.transformers_max_batch:
            continue
        p = _prompts(b, args.prompt_len, vocab, 10)
        run(p, 2)
        n = args.decode_tokens
        res[f"decode_b{b}_tok_s"] = b * (n - 1) / max(run(p, n) - run(p, 1), 1e-9)
    for n in args.prefill:
        p = _prompts(1, n, vocab, 3)
        run(p, 1)
        res[f"prefill_{n}_tok_s"] = n / statistics.median(run(p, 1) for _ in range(3))
    ref = None  # free the model before the next section
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m hybridrt.bench.cuda", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,256")
    ap.add_argument("--prefill", default="512,8192")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--transformers-max-batch", type=int, default=256)
    ap.add_argument("--phase-batches", default="1,32",
                    help="batch sizes of the per-phase step breakdown ('' for none)")
    ap.add_argument("--phase-steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=10,
                    help="decode steps under torch.profiler (0: no profile)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default=None, help="kernel backend (default: the device's)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--async-scheduling", choices=["on", "off"], default=None,
                    help="LLM's async_scheduling (default: the device's, on for CUDA)")
    ap.add_argument("--cache-memory", default="0.5",
                    help="KV + state cache budget (LLM's cache_memory: a fraction or bytes)")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny random model instead of the 0.8B shape (a dry run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.prefill = [int(x) for x in args.prefill.split(",")]
    args.phase_batches = [int(x) for x in args.phase_batches.split(",") if x]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cudabench: CUDA is not available in this PyTorch build / machine")

    from hybridrt.bench.fixtures import (
        QWEN35_08B_TEXT_CONFIG,
        random_state_dict,
        tiny_text_config,
        write_random_checkpoint,
    )
    from hybridrt.config import ModelConfig

    cuda = args.device == "cuda"
    report: dict = {"device": torch.cuda.get_device_name() if cuda else args.device,
                    "torch": torch.__version__, "args": {k: v for k, v in vars(args).items()}}
    bw = copy_bandwidth(4 << 30 if cuda else 64 << 20, device=args.device)
    t = time.perf_counter()
    text = tiny_text_config() if args.tiny else QWEN35_08B_TEXT_CONFIG
    sd = random_state_dict(ModelConfig.from_dict(text), seed=0, dtype=getattr(torch, args.dtype))
    with tempfile.TemporaryDirectory() as d:
        write_random_checkpoint(Path(d), text, state_dict=sd)
        report["checkpoint_s"] = time.perf_counter() - t
        report["ours"] = bench_ours(d, args)
    _save(report, args.json)
    wb = report["ours"]["weight_bytes"]
    report["roofline"] = {"copy_bytes_per_s": bw, "weight_bytes_per_step": wb,
                          "decode_b1_ceiling_tok_s": bw / wb}
    report["ours"]["decode_b1_fraction_of_ceiling"] = (
        report["ours"]["decode_b1_tok_s"] / report["roofline"]["decode_b1_ceiling_tok_s"]
        if "decode_b1_tok_s" in report["ours"] else None)
    if not args.no_transformers:
        try:
            report["transformers"] = bench_transformers(text, sd, args)
        except Exception as e:  # the baseline failing must not lose our figures
            report["transformers"] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(report, indent=2))
    _save(report, args.json)
    return report


def _save(report: dict, path: str | None) -> None:
    if path:  # after each part, so that a run cut short keeps what it measured
        Path(path).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
