"""What int8 weights cost in quality (``hybridrt bench quality``): the same model loaded in bf16
and with ``quantization="int8"``, both on the CPU backend, scoring the same token sequences.

- The demo model over held-out text: the documents about the standard-library objects that
  ``scripts/demo/make_corpus.py`` keeps out of training (its test split; every document about
  those objects, plain docstrings and chats). Reported: perplexity of each model, and how often
  the int8 model's greedy next token equals bf16's.
- A Qwen3.5-0.8B-shaped checkpoint with random weights over random token ids: the logits'
  relative error against bf16 (``||int8 - bf16|| / ||bf16||`` over all positions) and top-1
  agreement, and for scale the same for bf16 against fp32 weights.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import torch

from hybridrt.runner import build_batch
from hybridrt.statecache import CacheTensors

_ROWS = 32  # positions whose logits are computed at a time (0.8B: 248k-wide rows)


def held_out_texts(max_docs: int | None = None) -> list:
    """The demo corpus' test split (a repository checkout has scripts/demo/make_corpus.py):
    plain-text strings and chat message lists."""
    here = Path(__file__).resolve().parents[2] / "scripts" / "demo"
    if not (here / "make_corpus.py").is_file():
        raise FileNotFoundError(f"the held-out corpus is built by {here / 'make_corpus.py'}, "
                                f"which is in the repository, not in the installed package")
    sys.path.insert(0, str(here))
    try:
        import make_corpus
    finally:
        sys.path.remove(str(here))
    _, test, _ = make_corpus.build(0)
    docs = [d["text"] if "text" in d else d["messages"] for d in test]
    return docs[:max_docs] if max_docs else docs


@torch.inference_mode()
def score(model, sequences: list[list[int]], block_size: int = 16):
    """Run each sequence through ``model`` (one prefill) -> per sequence (log-prob of each next
    token [T - 1] fp64, greedy next token [T - 1])."""
    config = model.config
    out = []
    for ids in sequences:
        nblocks = -(-len(ids) // block_size)
        extra = len(model.mtp.layers) if model.mtp is not None else 0
        cache = CacheTensors.allocate(config, num_blocks=nblocks, num_slots=1,
                                      block_size=block_size, dtype=model.dtype,
                                      num_extra_attention_layers=extra)
        batch = build_batch([ids], [0], [list(range(nblocks))], block_size, [0], ["all"])
        hidden = model(batch, cache)[:-1]
        target = torch.tensor(ids[1:])
        lp, top = [], []
        for i in range(0, len(target), _ROWS):
            logits = model.compute_logits(hidden[i:i + _ROWS])
            lp.append(torch.log_softmax(logits.double(), -1)
                      .gather(1, target[i:i + _ROWS, None])[:, 0])
            top.append(logits.argmax(-1))
        out.append((torch.cat(lp), torch.cat(top)))
    return out


def _load(path, quantization, dtype="bfloat16"):
    from hybridrt import env
    from hybridrt.kernels.backend import CPUBackend
    from hybridrt.loader import load_model

    model, config, _ = load_model(path, dtype, with_mtp=False, quantization=quantization)
    model.set_backend(CPUBackend(config, options=env.kernel_options()))
    return model


def demo_quality(max_tokens: int = 256, max_docs: int | None = None) -> dict:
    """Perplexity and greedy agreement of the int8 demo model against bf16 on held-out text."""
    from transformers import PreTrainedTokenizerFast

    from hybridrt.llm import default_model

    path = default_model()
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    seqs = []
    for d in held_out_texts(max_docs):
        ids = (tok.encode(d) if isinstance(d, str)
               else tok.apply_chat_template(d, tokenize=True, return_dict=False))
        if len(ids) >= 2:
            seqs.append(list(ids)[:max_tokens])
    res = {}
    for name, q in (("bf16", None), ("int8", "int8")):
        res[name] = score(_load(path, q), seqs)
    nll = {n: -torch.cat([lp for lp, _ in r]).sum().item() for n, r in res.items()}
    tokens = sum(len(s) - 1 for s in seqs)
    agree = sum((a[1] == b[1]).sum().item() for a, b in zip(res["bf16"], res["int8"]))
    ppl = {n: math.exp(v / tokens) for n, v in nll.items()}
    return {"documents": len(seqs), "tokens": tokens, "ppl_bf16": ppl["bf16"],
            "ppl_int8": ppl["int8"], "ppl_change": ppl["int8"] / ppl["bf16"] - 1,
            "greedy_agreement": agree / tokens}


@torch.inference_mode()
def logits_quality(path: str | Path, num_seqs: int = 4, length: int = 64, seed: int = 0) -> dict:
    """Logits of the int8 model against bf16 on random token ids: relative error
    (``||int8 - bf16|| / ||bf16||``) and top-1 agreement; for scale, the same for bf16 against
    fp32 weights (random-weight models amplify small differences layer after layer)."""
    import gc

    g = torch.Generator().manual_seed(seed)
    logits = {}
    for name, dtype, q in (("fp32", "float32", None), ("bf16", "bfloat16", None),
                           ("int8", "bfloat16", "int8")):
        model = _load(path, q, dtype)
        vocab = model.config.vocab_size
        seqs = [torch.randint(0, vocab, (length,), generator=g.manual_seed(seed + i)).tolist()
                for i in range(num_seqs)]
        rows = []
        for ids in seqs:
            nblocks = -(-len(ids) // 16)
            cache = CacheTensors.allocate(model.config, num_blocks=nblocks, num_slots=1,
                                          block_size=16, dtype=model.dtype)
            batch = build_batch([ids], [0], [list(range(nblocks))], 16, [0], ["all"])
            hidden = model(batch, cache)
            rows += [model.compute_logits(hidden[i:i + _ROWS]) for i in range(0, length, _ROWS)]
        logits[name] = torch.cat(rows)
        del model, rows
        gc.collect()

    def compare(a, b):
        x, y = logits[a].double(), logits[b].double()
        top1 = (x.argmax(-1) == y.argmax(-1)).double().mean().item()
        return ((x - y).norm() / y.norm()).item(), top1

    err, top1 = compare("int8", "bf16")
    err_ref, top1_ref = compare("bf16", "fp32")
    return {"sequences": num_seqs, "positions": num_seqs * length, "logits_rel_error": err,
            "top1_agreement": top1, "bf16_vs_fp32_rel_error": err_ref,
            "bf16_vs_fp32_top1_agreement": top1_ref}


def run_quality(model_08b: str | None = None, skip_08b: bool = False, threads: int = 2,
                max_docs: int | None = None, json_path: str | Path | None = None) -> dict:
    """Both measurements -> the report (also printed as a table and written to ``json_path``).
    ``model_08b``: a 0.8B-shaped checkpoint (default: random bf16 weights written to a temporary
    directory)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        report = {"threads": threads, "demo": demo_quality(max_docs=max_docs)}
        if not skip_08b:
            tmp = None
            if model_08b is None:
                from hybridrt.bench.throughput import make_random_08b

                tmp = tempfile.TemporaryDirectory(prefix="hybridrt-08b-")
                print("writing a random-weight Qwen3.5-0.8B-shaped checkpoint (bf16) ...",
                      file=sys.stderr)
                model_08b = str(make_random_08b(tmp.name))
            report["random_08b"] = logits_quality(model_08b)
            if tmp is not None:
                tmp.cleanup()
    finally:
        torch.set_num_threads(before)
    print(format_table(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}", file=sys.stderr)
    return report


def format_table(report: dict) -> str:
    d = report["demo"]
    rows = [f"demo model, held-out text ({d['documents']} documents, {d['tokens']} tokens):",
            f"  {'perplexity bf16':<34}{d['ppl_bf16']:>10.4f}",
            f"  {'perplexity int8':<34}{d['ppl_int8']:>10.4f}",
            f"  {'perplexity change':<34}{100 * d['ppl_change']:>+9.2f}%",
            f"  {'greedy next-token agreement':<34}{100 * d['greedy_agreement']:>9.2f}%"]
    r = report.get("random_08b")
    if r:
        rows += [f"Qwen3.5-0.8B shape, random weights ({r['sequences']} x "
                 f"{r['positions'] // r['sequences']} random tokens):",
                 f"  {'logits relative error':<34}{100 * r['logits_rel_error']:>9.2f}%",
                 f"  {'top-1 agreement':<34}{100 * r['top1_agreement']:>9.2f}%",
                 "  for scale, bf16 against fp32 weights:",
                 f"  {'logits relative error':<34}{100 * r['bf16_vs_fp32_rel_error']:>9.2f}%",
                 f"  {'top-1 agreement':<34}{100 * r['bf16_vs_fp32_top1_agreement']:>9.2f}%"]
    return "\n".join(rows)
