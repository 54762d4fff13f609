"""Time an image request end to end: ``python -m hybridrt.bench.vision_e2e`` writes a
checkpoint with random bf16 weights (``bench.vision.write_checkpoint``; default: Qwen3.5-0.8B's
text model and tower, ``--config`` / ``--text-config`` for other shapes), loads it with
``LLM(dtype=..., threads=...)`` without prefix caching or the encoder cache (every run encodes
and prefills), and runs, per image size and repeat, one after the other:

- ``image``: ``<|vision_start|><|image_pad|><|vision_end|>`` and a ``--question``-token question;
- ``text``: a text-only prompt as long as the image prompt once its placeholder is expanded;
- ``question``: the question alone.

Each is greedy with ``ignore_eos`` for ``--decode`` tokens after the first, through
``LLM.stream_tokens``. TTFT is from the call to the first token (tokenizing and preprocessing
included). The image run's TTFT splits into ``preprocess_s`` and ``encoder_s``
(``RequestOutput.metrics["vision"]``) and ``prefill_s`` (the engine's TTFT, from the request's
arrival, less the encoder). Decode tok/s is the engine's ``decode_tokens_per_s`` (the tokens
after the first over their time); ``decode_ratio`` is image / text per repeat. Best and median
over ``--repeat``; ``--json FILE`` keeps the report."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hybridrt.bench.vision import QWEN35_08B_VISION, write_checkpoint

QUESTION = ("What is shown in this picture? Name the objects, their colours and where they "
            "are, and say what the scene is about. ")
KINDS = ("image", "text", "question")
PER_RUN = ("encoder_runs", "cached_tokens")  # kept per run: what each run did
LOWER_IS_BETTER = ("ttft", "engine_ttft", "preprocess_s", "encoder_s", "prefill_s")


def question_ids(tokenizer, n: int) -> list[int]:
    """``n`` token ids of ``QUESTION``, repeated as often as it takes."""
    ids = tokenizer.encode(QUESTION, add_special_tokens=False)
    return (ids * -(-n // len(ids)))[:n]


def image_of(height: int, width: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def run_once(llm, prompt, params) -> dict:
    """One request through ``stream_tokens``: its TTFT from the call, and its metrics (its
    TTFT on stderr at once, so that a slow run shows where it is)."""
    t0 = time.perf_counter()
    tokens = llm.stream_tokens(prompt, params)
    next(tokens)
    ttft = time.perf_counter() - t0
    print(f"{len(prompt['prompt_token_ids'])}-id prompt"
          f"{' with an image' if 'multi_modal_data' in prompt else ''}: TTFT {ttft:.3f} s",
          file=sys.stderr, flush=True)
    for _ in tokens:
        pass
    m = llm.last_stream_output.metrics
    if m["num_generated_tokens"] != params.max_tokens:
        raise RuntimeError(f"{m['num_generated_tokens']} tokens generated, "
                           f"{params.max_tokens} asked for")
    out = {"prompt_tokens": m["num_prompt_tokens"], "cached_tokens": m["num_cached_tokens"],
           "ttft": ttft,
           "engine_ttft": m["time_to_first_token"], "decode_tok_s": m["decode_tokens_per_s"]}
    if "vision" in m:
        v = m["vision"]
        out.update(preprocess_s=v["preprocess_seconds"], encoder_s=v["encoder_seconds"],
                   prefill_s=m["time_to_first_token"] - v["encoder_seconds"],
                   encoder_runs=v["encoder_runs"], image_tokens=v["num_image_tokens"])
    return out


def summarize(runs: list[dict]) -> dict:
    """Per figure: best (the least time, the most tok/s) and median over the runs; counts as
    their list."""
    out: dict = {}
    for key in runs[0]:
        vals = [r[key] for r in runs]
        if isinstance(vals[0], int):
            out[key] = vals if len(set(vals)) > 1 or key in PER_RUN else vals[0]
        else:
            best = min(vals) if key in LOWER_IS_BETTER else max(vals)
            out[key] = {"best": best, "median": statistics.median(vals)}
    return out


def bench(model: str | Path, sizes: list[tuple[int, int]], repeat: int = 3, decode: int = 32,
          question: int = 32, threads: int = 2, dtype: str = "bfloat16",
          warmup: int = 1) -> dict:
    """The report: per size, each kind's runs summarized and the decode ratio image / text."""
    from hybridrt.llm import LLM
    from hybridrt.sampling_params import SamplingParams

    cfg = json.loads((Path(model) / "config.json").read_text())
    side = cfg["vision_config"]["spatial_merge_size"] * cfg["vision_config"]["patch_size"]
    tokens = max(64, max(h * w for h, w in sizes) // side ** 2)  # write_checkpoint's limits
    longest = tokens + question + decode + 64
    llm = LLM(str(model), dtype=dtype, threads=threads, enable_prefix_caching=False,
              encoder_cache_memory=0, max_model_len=longest)
    params = SamplingParams(temperature=0.0, max_tokens=decode + 1, ignore_eos=True)
    q = question_ids(llm.tokenizer, question)
    placeholder = [cfg["vision_start_token_id"], cfg["image_token_id"], cfg["vision_end_token_id"]]
    runs: dict[str, dict[str, list[dict]]] = {f"{h}x{w}": {k: [] for k in KINDS}
                                              for h, w in sizes}
    for i in range(warmup + repeat):
        for h, w in sizes:
            image = {"prompt_token_ids": placeholder + q,
                     "multi_modal_data": {"image": [image_of(h, w, seed=0)]}}
            got = {"image": run_once(llm, image, params)}
            n = got["image"]["prompt_tokens"]
            got["text"] = run_once(llm, {"prompt_token_ids": (q * -(-n // len(q)))[:n]}, params)
            got["question"] = run_once(llm, {"prompt_token_ids": q}, params)
            if i >= warmup:
                for kind in KINDS:
                    runs[f"{h}x{w}"][kind].append(got[kind])
    rows = []
    for size, by_kind in runs.items():
        ratios = [a["decode_tok_s"] / b["decode_tok_s"]
                  for a, b in zip(by_kind["image"], by_kind["text"])]
        row = {"size": size, **{k: summarize(v) for k, v in by_kind.items()}}
        row["decode_ratio"] = {"median": statistics.median(ratios),
                               "best_over_best": row["image"]["decode_tok_s"]["best"]
                               / row["text"]["decode_tok_s"]["best"]}
        rows.append(row)
    return {"threads": threads, "dtype": dtype, "repeat": repeat, "warmup": warmup,
            "decode_tokens": decode, "question_tokens": question,
            "text_layers": cfg["text_config"]["num_hidden_layers"],
            "vision": cfg["vision_config"], "load": [round(v, 2) for v in os.getloadavg()],
            "rows": rows}


def table(report: dict) -> str:
    def bm(fig: dict | None, fmt: str) -> str:
        return "-" if fig is None else f"{fig['best']:{fmt}} / {fig['median']:{fmt}}"

    def one(fig: dict | None) -> str:
        return "-" if fig is None else f"{fig['median']:.3f}"

    lines = [f"{'size':<10} {'run':<9} {'prompt':>6}  {'TTFT s best / median':>21}  "
             f"{'preproc':>7} {'encoder':>7} {'prefill':>7}  {'decode tok/s best / median':>26}"]
    for row in report["rows"]:
        for kind in KINDS:
            r = row[kind]
            lines.append(f"{row['size']:<10} {kind:<9} {r['prompt_tokens']!s:>6}  "
                         f"{bm(r['ttft'], '.3f'):>21}  {one(r.get('preprocess_s')):>7} "
                         f"{one(r.get('encoder_s')):>7} {one(r.get('prefill_s')):>7}  "
                         f"{bm(r['decode_tok_s'], '.2f'):>26}")
        d = row["decode_ratio"]
        lines.append(f"{row['size']:<10} decode image / text: median {d['median']:.3f}, "
                     f"best / best {d['best_over_best']:.3f}")
    lines.append(f"{report['threads']} threads, {report['dtype']}, {report['repeat']} repeats; "
                 f"split columns are medians; load average "
                 f"{' '.join(str(v) for v in report['load'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="448x448,1024x768", help="HxW,HxW,...")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    ap.add_argument("--decode", type=int, default=32, help="tokens timed after the first")
    ap.add_argument("--question", type=int, default=32, help="the question's tokens")
    ap.add_argument("--config", default=None,
                    help="a vision_config as JSON (default: Qwen3.5-0.8B's)")
    ap.add_argument("--text-config", default=None,
                    help="a text config as JSON (default: Qwen3.5-0.8B's)")
    ap.add_argument("--model-dir", default=None,
                    help="write the checkpoint here and keep it (a directory that already "
                         "holds config.json is used as it is); default: a temporary one")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the report here")
    a = ap.parse_args(argv)
    from hybridrt.bench.fixtures import QWEN35_08B_TEXT_CONFIG

    vision = json.loads(a.config) if a.config else QWEN35_08B_VISION
    text = json.loads(a.text_config) if a.text_config else QWEN35_08B_TEXT_CONFIG
    sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(a.model_dir or tmp)
        if not (model / "config.json").exists():
            write_checkpoint(model, vision, text=text)
        report = bench(model, sizes, a.repeat, a.decode, a.question, a.threads, a.dtype,
                       a.warmup)
    print(table(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
