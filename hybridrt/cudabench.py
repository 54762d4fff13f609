"""GPU benchmark: hybridrt's CUDA backend against transformers on the same GPU.

The Qwen3.5-0.8B shape with random bf16 weights (written to a temporary directory unless
``--model`` names a checkpoint). Reported, all from one run:

- ``roofline``: device copy bandwidth (bytes read + written per second) and the batch-1 decode
  ceiling it implies, bandwidth / bytes of weights read per step;
- ``ours``: decode tok/s at each batch size (every request decodes ``--decode-tokens`` tokens
  after a ``--prompt-len`` prompt; prefill excluded: the clock starts once every request has
  its first token), prefill tok/s of one prompt of each ``--prefill`` length (time to first
  token);
- ``transformers``: the same figures for ``Qwen3_5ForCausalLM.generate`` (fla kernels when
  fla is installed), decode from the difference of an n-token and a 1-token generate.

``python -m hybridrt.cudabench --json out.json`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _sync() -> None:
    torch.cuda.synchronize()


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def copy_bandwidth(nbytes: int = 4 << 30, repeats: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (median of ``repeats``)."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
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


def bench_ours(model_dir, args) -> dict:
    from hybridrt.llm import LLM
    from hybridrt.sampling_params import SamplingParams

    max_len = max(max(args.prefill), args.prompt_len + args.decode_tokens) + 16
    t = time.perf_counter()
    llm = LLM(model_dir, dtype="bfloat16", device="cuda", max_model_len=max_len,
              max_num_seqs=max(args.batches), max_num_batched_tokens=max(args.prefill),
              cache_memory=0.5, tokenizer=None)
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
    for n in args.prefill:
        res[f"prefill_{n}_tok_s"] = prefill_rate(eng, _prompts(1, n, vocab, 3)[0])
    res["num_graphs"] = len(getattr(eng.runner.backend, "graphs", {}))
    weights = sum(p.numel() * p.element_size() for n, p in llm.model.named_parameters()
                  if not n.startswith("mtp."))
    res["weight_bytes"] = weights
    del llm, eng
    torch.cuda.empty_cache()
    return res


def bench_transformers(text_config, state_dict, args) -> dict:
    from hybridrt.testing import hf_reference_model

    ref = hf_reference_model(text_config, state_dict, torch.bfloat16).cuda()
    vocab = text_config["vocab_size"]
    res: dict = {}
    try:
        import fla  # noqa: F401

        res["fla"] = True
    except ImportError:
        res["fla"] = False

    def run(ids, n):
        x = torch.tensor(ids, device="cuda")
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
    torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m hybridrt.cudabench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,256")
    ap.add_argument("--prefill", default="512,8192")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--transformers-max-batch", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.prefill = [int(x) for x in args.prefill.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("cudabench: CUDA is not available in this PyTorch build / machine")

    from hybridrt.config import ModelConfig
    from hybridrt.testing import QWEN35_08B_TEXT_CONFIG, random_state_dict, write_random_checkpoint

    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "args": {k: v for k, v in vars(args).items()}}
    bw = copy_bandwidth()
    t = time.perf_counter()
    text = QWEN35_08B_TEXT_CONFIG
    sd = random_state_dict(ModelConfig.from_dict(text), seed=0, dtype=torch.bfloat16)
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
