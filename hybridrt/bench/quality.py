"""What quantized weights cost in quality (``hybridrt bench quality``): the same model loaded
in bf16 and with ``quantization="int8"`` and ``"int4"``, all on the CPU backend, scoring the same
token sequences.

- The demo model over held-out text: the documents about the standard-library objects that
  ``scripts/demo/make_corpus.py`` keeps out of training (its test split; every document about
  those objects, plain docstrings and chats). Reported: perplexity of each model, and how often
  each quantized model's greedy next token equals bf16's.
- With GGUFs of the demo model (``llamacpp_ggufs``: llama.cpp's bf16 and, e.g., Q4_K_M, Q4_0):
  the held-out documents joined into one text, scored as ``llama-perplexity`` scores a file
  (chunks of 512 tokens, the second half of each), three ways: our models; llama.cpp's own
  ``llama-perplexity`` on each GGUF; and each GGUF's tensors dequantized (the ``gguf`` package)
  into our bf16 model, so that llama.cpp's formats and ours are compared on one computation.
- ``--model``: another trained checkpoint in the demo's tokenizer in its place (e.g. a small
  MoE from ``scripts/demo/train.py --experts``); ``--mixed PARTS``: int4 with the weights whose
  names hold one of PARTS at 8 bits (``hybridrt quantize --int8``) as one more model. Each
  model's weight bytes are reported, and what a batch-1 token reads of them
  (``ceilings.weight_bytes_per_token``: the routed experts' share top-k / experts): the
  quality-per-byte choice of docs/moe.md.
- A Qwen3.5-0.8B-shaped checkpoint with random weights over random token ids: the logits'
  relative error against bf16 (``||q - bf16|| / ||bf16||`` over all positions) and top-1
  agreement, and for scale the same for bf16 against fp32 weights.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import torch

from hybridrt.bench.ceilings import weight_bytes_per_token
from hybridrt.kernels import quant
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


def _load(path, quantization, dtype="bfloat16", int8_parts: tuple[str, ...] = ()):
    from hybridrt import env
    from hybridrt.kernels.backend import CPUBackend
    from hybridrt.loader import load_model

    model, config, _ = load_model(path, dtype, with_mtp=False, quantization=quantization,
                                  int8_parts=int8_parts)
    model.set_backend(CPUBackend(config, options=env.kernel_options()))
    return model


QUANTIZATIONS = ("int8", "int4")


def _variants(quantizations, mixed) -> list[tuple[str, str | None, tuple[str, ...]]]:
    """(name, quantization, int8 parts) of each model scored, bf16 first."""
    return [("bf16", None, ()), *((q, q, ()) for q in quantizations),
            *((f"int4+int8:{','.join(m)}", "int4", tuple(m)) for m in mixed)]


def demo_quality(max_tokens: int = 256, max_docs: int | None = None,
                 quantizations=QUANTIZATIONS, pbar=None, model: str | None = None,
                 mixed: tuple[tuple[str, ...], ...] = ()) -> dict:
    """Perplexity and greedy agreement of the quantized demo models against bf16 on held-out
    text -> {"documents", "tokens", "ppl_bf16", and per quantization q "ppl_<q>",
    "ppl_change_<q>", "greedy_agreement_<q>"; "bytes": per model (weight bytes, a batch-1
    token's)}. ``model``: a checkpoint in the demo's tokenizer in its place; ``mixed``: int4
    models with these parts at 8 bits, besides. ``pbar``: a progress bar
    (hybridrt.bench.progress) counting each model scored."""
    from transformers import PreTrainedTokenizerFast

    from hybridrt.bench import progress
    from hybridrt.llm import default_model

    pbar = pbar if pbar is not None else progress.silent()

    path = model or default_model()
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    seqs = []
    for d in held_out_texts(max_docs):
        ids = (tok.encode(d) if isinstance(d, str)
               else tok.apply_chat_template(d, tokenize=True, return_dict=False))
        if len(ids) >= 2:
            seqs.append(list(ids)[:max_tokens])
    res, sizes = {}, {}
    for name, q, parts in _variants(quantizations, mixed):
        progress.step(pbar, f"demo model, {name}")
        net = _load(path, q, int8_parts=parts)
        sizes[name] = (quant.weight_bytes(net), weight_bytes_per_token(net))
        res[name] = score(net, seqs)
        del net
        pbar.update()
    nll = {n: -torch.cat([lp for lp, _ in r]).sum().item() for n, r in res.items()}
    tokens = sum(len(s) - 1 for s in seqs)
    ppl = {n: math.exp(v / tokens) for n, v in nll.items()}
    out = {"documents": len(seqs), "tokens": tokens, "ppl_bf16": ppl["bf16"], "bytes": sizes}
    if model:
        out["model"] = str(model)
    for q in [n for n in res if n != "bf16"]:
        agree = sum((a[1] == b[1]).sum().item() for a, b in zip(res["bf16"], res[q]))
        out.update({f"ppl_{q}": ppl[q], f"ppl_change_{q}": ppl[q] / ppl["bf16"] - 1,
                    f"greedy_agreement_{q}": agree / tokens})
    return out


def held_out_text(tok) -> str:
    """The held-out documents as one text (chats through the chat template), blank lines
    between them: the file ``llama-perplexity`` reads."""
    return "\n\n".join(d if isinstance(d, str) else tok.apply_chat_template(d, tokenize=False)
                        for d in held_out_texts())


@torch.inference_mode()
def chunked_perplexity(model, ids: list[int], n_ctx: int = 512) -> tuple[float, int]:
    """Perplexity as ``llama-perplexity`` computes it: ``ids`` cut into whole chunks of ``n_ctx``
    tokens, each run from an empty cache, the tokens of its second half scored (each predicted
    from all before it in the chunk) -> (perplexity, tokens scored)."""
    chunks = [ids[i:i + n_ctx] for i in range(0, len(ids) - n_ctx + 1, n_ctx)]
    first = n_ctx // 2
    nll, count = 0.0, 0
    for lp, _ in score(model, chunks):
        nll -= lp[first:].sum().item()
        count += len(lp) - first
    return math.exp(nll / count), count


# GGUF tensor names of the demo model's (Qwen3.5's) matrices, llama.cpp's converter's: ours ->
# theirs (blk.N. + this + .weight)
_GGUF_NAMES = {
    "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.out_proj": "ssm_out", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str | None:
    """Our parameter name of a matrix -> its GGUF tensor name (None for the MTP layer's)."""
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".")
    if parts[:2] != ["model", "layers"] or parts[-1] != "weight":
        return None
    return f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:-1])]}.weight"


def gguf_matrices(path: str | Path) -> tuple[str, dict[str, torch.Tensor]]:
    """A GGUF's file type (e.g. "Q4_K_M") and its 2-D tensors dequantized to fp32 by the
    ``gguf`` package -> (type, {GGUF name: [rows, columns]})."""
    try:
        import gguf
        from gguf.quants import dequantize
    except ImportError:
        raise RuntimeError("reading GGUF files needs the gguf package: pip install gguf") from None
    import numpy as np

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.file_type")
    kind = (gguf.LlamaFileType(int(field.parts[-1][0])).name.removeprefix("MOSTLY_")
            if field is not None else "?")
    out = {}
    for t in reader.tensors:
        if len(t.shape) == 2:
            a = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            out[t.name] = torch.from_numpy(a.reshape(int(t.shape[1]), int(t.shape[0])).copy())
    return kind, out


def model_with_gguf_weights(path, tensors: dict[str, torch.Tensor], check: str | None = None):
    """The bf16 model at ``path`` (CPU backend) with every layer matrix and the embedding
    replaced by ``tensors`` (``gguf_matrices``'), rounded to bf16. ``check``: "exact" (a bf16
    GGUF: each must equal ours) or "close" (each within 30% relative error of ours, which a
    mismatched name or layout would not be); ValueError naming the first that is not."""
    model = _load(path, None)
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = gguf_name(name) if p.dim() == 2 else None
            if g is None:
                continue
            if g not in tensors or tensors[g].shape != p.shape:
                raise ValueError(f"GGUF tensor {g} missing or not {list(p.shape)}")
            new = tensors[g].to(p.dtype)
            err = ((new.float() - p.float()).norm() / p.float().norm()).item()
            if (check == "exact" and not torch.equal(new, p)) or (check == "close" and err > 0.3):
                raise ValueError(f"GGUF tensor {g} is not this model's {name} "
                                 f"(relative difference {err:.3g})")
            p.copy_(new)
    return model


def llamacpp_perplexity(gguf: str | Path, text_file: str | Path, bins: Path, threads: int,
                        n_ctx: int = 512) -> float:
    """``llama-perplexity`` on ``text_file`` -> its final estimate."""
    import re
    import subprocess

    out = subprocess.run([str(bins / "llama-perplexity"), "-m", str(gguf), "-f", str(text_file),
                          "-t", str(threads), "-c", str(n_ctx)], capture_output=True, text=True,
                         check=False)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if out.returncode or not found:
        tail = (out.stderr.strip().splitlines() or [""])[-1]
        raise RuntimeError(f"llama-perplexity failed on {gguf} ({out.returncode}): {tail}")
    return float(found.group(1))


def versus_llamacpp(ggufs: list, bins: Path | None, threads: int,
                    quantizations=QUANTIZATIONS, n_ctx: int = 512, pbar=None) -> dict:
    """The demo model's held-out text scored as llama-perplexity scores it, by our bf16 and
    quantized models, by llama.cpp on each GGUF, and by our model holding each GGUF's tensors
    -> {"chunks", "tokens", "ours": {weights: ppl}, "gguf": {type: {"llamacpp": ppl,
    "dequantized_in_ours": ppl}}}; changes against bf16 and the GGUF of type BF16 added by
    ``format_table``. ``pbar``: as ``demo_quality``'s, counting each model and GGUF."""
    from transformers import PreTrainedTokenizerFast

    from hybridrt.bench import progress
    from hybridrt.llm import default_model

    pbar = pbar if pbar is not None else progress.silent()

    path = default_model()
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    text = held_out_text(tok)
    ids = tok.encode(text)
    ours = {}
    for name, q in (("bf16", None), *((q, q) for q in quantizations)):
        progress.step(pbar, f"chunked perplexity, {name}")
        ours[name], count = chunked_perplexity(_load(path, q), ids, n_ctx)
        pbar.update()
    res = {"n_ctx": n_ctx, "tokens_scored": count, "ours": ours, "gguf": {}}
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "held_out.txt"
        text_file.write_text(text)
        for g in ggufs:
            progress.step(pbar, f"GGUF {Path(g).name}")
            kind, tensors = gguf_matrices(g)
            model = model_with_gguf_weights(path, tensors, "exact" if kind in ("BF16", "ALL_F32")
                                            else "close")
            entry = {"file": str(g),
                     "dequantized_in_ours": chunked_perplexity(model, ids, n_ctx)[0]}
            if bins is not None:
                entry["llamacpp"] = llamacpp_perplexity(g, text_file, bins, threads, n_ctx)
            res["gguf"][kind] = entry
            pbar.update()
    return res


@torch.inference_mode()
def logits_quality(path: str | Path, num_seqs: int = 4, length: int = 64, seed: int = 0,
                   quantizations=QUANTIZATIONS, pbar=None) -> dict:
    """Logits of the quantized models against bf16 on random token ids: relative error
    (``||q - bf16|| / ||bf16||``) and top-1 agreement; for scale, the same for bf16 against
    fp32 weights (random-weight models amplify small differences layer after layer).
    ``pbar``: as ``demo_quality``'s, counting each model."""
    import gc

    from hybridrt.bench import progress

    pbar = pbar if pbar is not None else progress.silent()

    g = torch.Generator().manual_seed(seed)
    logits = {}
    for name, dtype, q in (("fp32", "float32", None), ("bf16", "bfloat16", None),
                           *((q, "bfloat16", q) for q in quantizations)):
        progress.step(pbar, f"0.8B shape, {name}")
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
        pbar.update()

    def compare(a, b):
        x, y = logits[a].double(), logits[b].double()
        top1 = (x.argmax(-1) == y.argmax(-1)).double().mean().item()
        return ((x - y).norm() / y.norm()).item(), top1

    out = {"sequences": num_seqs, "positions": num_seqs * length}
    for q in quantizations:
        out[f"logits_rel_error_{q}"], out[f"top1_agreement_{q}"] = compare(q, "bf16")
    out["bf16_vs_fp32_rel_error"], out["bf16_vs_fp32_top1_agreement"] = compare("bf16", "fp32")
    return out


def run_quality(model_08b: str | None = None, skip_08b: bool = False, threads: int = 2,
                max_docs: int | None = None, json_path: str | Path | None = None,
                llamacpp_ggufs: list | None = None, llamacpp_bin: str | Path | None = None,
                model: str | None = None, mixed: tuple[tuple[str, ...], ...] = ()) -> dict:
    """The measurements -> the report (also printed as a table and written to ``json_path``).
    ``model_08b``: a 0.8B-shaped checkpoint (default: random bf16 weights written to a temporary
    directory). ``llamacpp_ggufs``: GGUFs of the demo model (``versus_llamacpp``; its
    ``llama-perplexity`` from ``llamacpp_bin``, default as ``bench throughput``'s). ``model``,
    ``mixed``: as ``demo_quality``'s."""
    from hybridrt.bench import progress

    models = 1 + len(QUANTIZATIONS) + len(mixed)
    pbar = progress.bar("quality", models + (models + len(llamacpp_ggufs) if llamacpp_ggufs
                                             else 0)
                        + (0 if skip_08b else 1 + models + (model_08b is None)), unit="model")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        report = {"threads": threads, "demo": demo_quality(max_docs=max_docs, pbar=pbar,
                                                           model=model, mixed=mixed)}
        if llamacpp_ggufs:
            from hybridrt.bench import llamacpp

            bins = llamacpp.bin_dir(llamacpp_bin)
            if not (bins / "llama-perplexity").is_file():
                bins = None
                print(f"no llama-perplexity in {llamacpp.bin_dir(llamacpp_bin)}: the GGUFs are "
                      f"scored in our model only", file=sys.stderr)
            report["versus_llamacpp"] = versus_llamacpp(llamacpp_ggufs, bins, threads,
                                                        pbar=pbar)
        if not skip_08b:
            tmp = None
            if model_08b is None:
                from hybridrt.bench.throughput import make_random_08b

                tmp = tempfile.TemporaryDirectory(prefix="hybridrt-08b-")
                progress.step(pbar, "writing a random-weight 0.8B-shaped checkpoint")
                model_08b = str(make_random_08b(tmp.name))
                pbar.update()
            report["random_08b"] = logits_quality(model_08b, pbar=pbar)
            if tmp is not None:
                tmp.cleanup()
    finally:
        torch.set_num_threads(before)
        pbar.close()
    print(format_table(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}", file=sys.stderr)
    return report


def format_table(report: dict) -> str:
    d = report["demo"]
    qs = [k.removeprefix("ppl_change_") for k in d if k.startswith("ppl_change_")]
    rows = [f"{d.get('model', 'demo model')}, held-out text ({d['documents']} documents, "
            f"{d['tokens']} tokens):",
            f"  {'perplexity bf16':<34}{d['ppl_bf16']:>10.4f}"]
    for q in qs:
        rows += [f"  {'perplexity ' + q:<34}{d['ppl_' + q]:>10.4f} "
                 f"({100 * d['ppl_change_' + q]:+.2f}%)",
                 f"  {'greedy next-token agreement ' + q:<34}"
                 f"{100 * d['greedy_agreement_' + q]:>9.2f}%"]
    if "bytes" in d:
        rows.append(f"  {'weights':<34}{'MB':>10}{'a token reads, MB':>20}")
        for name, (total, token) in d["bytes"].items():
            rows.append(f"  {name:<34}{total / 1e6:>10.2f}{token / 1e6:>20.2f}")
    v = report.get("versus_llamacpp")
    if v:
        base = v["ours"]["bf16"]
        rows.append(f"demo model, the same text as llama-perplexity scores it (chunks of "
                    f"{v['n_ctx']}, {v['tokens_scored']} tokens scored): perplexity (change "
                    f"against bf16)")
        rows.append(f"  {'weights':<26}{'hybridrt':>18}{'GGUF in hybridrt':>20}"
                    f"{'llama-perplexity':>20}")
        for name, p in v["ours"].items():
            rows.append(f"  {name:<26}{p:>9.4f} ({100 * (p / base - 1):+.2f}%)")
        ref = v["gguf"].get("BF16", {}).get("llamacpp")
        for kind, e in v["gguf"].items():
            ours = e["dequantized_in_ours"]
            line = (f"  {'llama.cpp ' + kind:<26}{'':>18}{ours:>11.4f} "
                    f"({100 * (ours / base - 1):+.2f}%)")
            if "llamacpp" in e:
                change = f" ({100 * (e['llamacpp'] / ref - 1):+.2f}%)" if ref else ""
                line += f"{e['llamacpp']:>11.4f}{change}"
            rows.append(line)
    r = report.get("random_08b")
    if r:
        rows += [f"Qwen3.5-0.8B shape, random weights ({r['sequences']} x "
                 f"{r['positions'] // r['sequences']} random tokens):"]
        for q in [k.removeprefix("top1_agreement_") for k in r if k.startswith("top1_agree")]:
            rows += [f"  {'logits relative error ' + q:<34}"
                     f"{100 * r['logits_rel_error_' + q]:>9.2f}%",
                     f"  {'top-1 agreement ' + q:<34}{100 * r['top1_agreement_' + q]:>9.2f}%"]
        rows += ["  for scale, bf16 against fp32 weights:",
                 f"  {'logits relative error':<34}{100 * r['bf16_vs_fp32_rel_error']:>9.2f}%",
                 f"  {'top-1 agreement':<34}{100 * r['bf16_vs_fp32_top1_agreement']:>9.2f}%"]
    return "\n".join(rows)
