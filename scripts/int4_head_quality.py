"""The demo model's quality, int4 with its LM head in 6 bits (now) and in int8 (before), in one
run beside bf16, int8 and llama.cpp's GGUF tensors dequantized into our model: ``bench
quality``'s per-document perplexity and greedy agreement, and its chunked (llama-perplexity's
way) one (docs/performance.md, "The LM head in 6 bits"). One thread.

    python scripts/int4_head_quality.py [demo-bf16.gguf demo-Q4_K_M.gguf ...]
"""
import json
import math
import sys
import time
from contextlib import contextmanager

import torch
from transformers import PreTrainedTokenizerFast

from hybridrt import loader
from hybridrt.bench import quality
from hybridrt.llm import default_model

torch.set_num_threads(1)
t0 = time.time()


@contextmanager
def int8_head():  # quantization="int4" as it was: the embedding / LM head in int8
    saved = loader._FORMATS["int6"]
    loader._FORMATS["int6"] = loader._FORMATS["int8"]
    try:
        yield
    finally:
        loader._FORMATS["int6"] = saved


@contextmanager
def nothing():
    yield


variants = {"bf16": (None, nothing), "int8": ("int8", nothing), "int4": ("int4", nothing),
            "int4-int8-head": ("int4", int8_head)}
path = default_model()
tok = PreTrainedTokenizerFast.from_pretrained(path)
seqs = []
for d in quality.held_out_texts():
    ids = (tok.encode(d) if isinstance(d, str)
           else tok.apply_chat_template(d, tokenize=True, return_dict=False))
    if len(ids) >= 2:
        seqs.append(list(ids)[:256])
text_ids = tok.encode(quality.held_out_text(tok))
res, chunked = {}, {}
for name, (q, patch) in variants.items():
    with patch():
        model = quality._load(path, q)
        head = model.model.embed_tokens.qweight if q else None
        print(name, type(head).__name__, flush=True)
        res[name] = quality.score(model, seqs)
        chunked[name], count = quality.chunked_perplexity(model, text_ids, 512)
for g in sys.argv[1:]:
    kind, tensors = quality.gguf_matrices(g)
    model = quality.model_with_gguf_weights(path, tensors, "exact" if kind == "BF16" else "close")
    chunked[f"gguf-{kind}"] = quality.chunked_perplexity(model, text_ids, 512)[0]
tokens = sum(len(s) - 1 for s in seqs)
ppl = {n: math.exp(-torch.cat([lp for lp, _ in r]).sum().item() / tokens) for n, r in res.items()}
out = {"documents": len(seqs), "tokens": tokens, "chunk_tokens": count}
for n in res:
    agree = sum((a[1] == b[1]).sum().item() for a, b in zip(res["bf16"], res[n])) / tokens
    out[n] = {"ppl": ppl[n], "change": ppl[n] / ppl["bf16"] - 1, "greedy": agree,
              "chunked": chunked[n], "chunked_change": chunked[n] / chunked["bf16"] - 1}
for n in chunked:
    if n.startswith("gguf"):
        out[n] = {"chunked": chunked[n], "chunked_change": chunked[n] / chunked["bf16"] - 1}
print(json.dumps(out, indent=1))
print(f"{time.time() - t0:.0f} s")
