"""``hybridrt bench kv-quality``: what the int8 KV cache costs in quality, on the demo model.

The held-out documents (``quality.held_out_text``: the demo corpus' test split, the text
``bench quality --against-llamacpp`` scores) as one token stream, cut into windows of ``n_ctx``
tokens; each window is run from an empty cache in prompt chunks of ``chunk`` tokens (as the
engine chunks a long prompt: every chunk after the first reads the cached KV), once with bf16
KV and once with int8 KV, the same bf16 weights and CPU backend. Scored as ``llama-perplexity``
scores: the second half of each window. Reported per KV dtype: perplexity; and for int8
against bf16: the mean and largest KL(bf16 || int8) of the next-token distributions, and how
often the greedy next tokens agree.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from hybridrt.runner import build_batch
from hybridrt.statecache import CacheTensors

_KV = {"bf16": torch.bfloat16, "int8": torch.int8}


@torch.inference_mode()
def window_logprobs(model, ids: list[int], kv_dtype: torch.dtype, chunk: int = 512,
                    block_size: int = 16) -> torch.Tensor:
    """Log-probabilities [len(ids), vocab] fp32 of the next token after each of ``ids``, the
    window prefilled from an empty cache (KV in ``kv_dtype``) in chunks of ``chunk`` tokens."""
    nblocks = -(-len(ids) // block_size)
    cache = CacheTensors.allocate(model.config, num_blocks=nblocks, num_slots=1,
                                  block_size=block_size, dtype=model.dtype, kv_dtype=kv_dtype)
    table = list(range(nblocks))
    out = []
    for s in range(0, len(ids), chunk):
        batch = build_batch([ids[s:s + chunk]], [s], [table], block_size, [0], ["all"])
        hidden = model(batch, cache)
        out += [torch.log_softmax(model.compute_logits(hidden[i:i + 64]).float(), -1)
                for i in range(0, hidden.shape[0], 64)]
    return torch.cat(out)


def compare(model, ids: list[int], n_ctx: int = 2048, chunk: int = 512,
            kv_dtypes=("bf16", "int8")) -> dict:
    """``ids`` in windows of ``n_ctx`` tokens, with each KV dtype -> the figures (module
    docstring); the first of ``kv_dtypes`` is the one the others are compared against."""
    windows = [ids[i:i + n_ctx] for i in range(0, len(ids) - n_ctx + 1, n_ctx)]
    if not windows:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {n_ctx}")
    first = n_ctx // 2
    base = kv_dtypes[0]
    nll = dict.fromkeys(kv_dtypes, 0.0)
    kl_sum = {k: 0.0 for k in kv_dtypes[1:]}
    kl_max = {k: 0.0 for k in kv_dtypes[1:]}
    agree = {k: 0 for k in kv_dtypes[1:]}
    count = 0
    for w in windows:
        target = torch.tensor(w[first + 1:])
        lps = {k: window_logprobs(model, w, _KV[k], chunk)[first:-1] for k in kv_dtypes}
        count += len(target)
        for k, lp in lps.items():
            nll[k] -= lp.gather(1, target[:, None]).double().sum().item()
        ref = lps[base]
        for k in kv_dtypes[1:]:
            kl = (ref.exp() * (ref - lps[k])).sum(-1).double()
            kl_sum[k] += kl.sum().item()
            kl_max[k] = max(kl_max[k], kl.max().item())
            agree[k] += (ref.argmax(-1) == lps[k].argmax(-1)).sum().item()
    out = {"windows": len(windows), "n_ctx": n_ctx, "chunk": chunk, "tokens_scored": count}
    for k in kv_dtypes:
        out[f"ppl_{k}"] = math.exp(nll[k] / count)
    for k in kv_dtypes[1:]:
        out.update({f"ppl_change_{k}": out[f"ppl_{k}"] / out[f"ppl_{base}"] - 1,
                    f"kl_mean_{k}": kl_sum[k] / count, f"kl_max_{k}": kl_max[k],
                    f"greedy_agreement_{k}": agree[k] / count})
    return out


def run(n_ctx: int = 2048, chunk: int = 512, threads: int = 2, max_windows: int | None = None,
        json_path: str | None = None) -> dict:
    """The demo model over the held-out text, bf16 against int8 KV; printed as a table."""
    from transformers import PreTrainedTokenizerFast

    from hybridrt.bench.quality import _load, held_out_text
    from hybridrt.llm import default_model

    torch.set_num_threads(threads)
    path = default_model()
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    ids = tok.encode(held_out_text(tok))
    if max_windows:
        ids = ids[:max_windows * n_ctx]
    report = compare(_load(path, None), ids, n_ctx, chunk)
    report.update(threads=threads, text_tokens=len(ids), load=os.getloadavg())
    print(table(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    return report


def table(r: dict) -> str:
    return "\n".join([
        f"demo model, held-out text: {r['windows']} windows of {r['n_ctx']} tokens (prefilled in "
        f"chunks of {r['chunk']}), {r['tokens_scored']} tokens scored",
        f"{'KV':<5} {'perplexity':>11} {'change':>8} {'mean KL':>9} {'max KL':>8} "
        f"{'greedy agree':>13}",
        f"{'bf16':<5} {r['ppl_bf16']:>11.4f}",
        f"{'int8':<5} {r['ppl_int8']:>11.4f} {100 * r['ppl_change_int8']:>+7.3f}% "
        f"{r['kl_mean_int8']:>9.2e} {r['kl_max_int8']:>8.2e} "
        f"{r['greedy_agreement_int8']:>13.4f}",
    ])
