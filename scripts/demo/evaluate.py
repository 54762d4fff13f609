"""Evaluate the demo checkpoint: greedy MTP acceptance on held-out prompts, sample generations,
and (``--check``) that the files load everywhere they must.

Acceptance (k=1, greedy): the trunk answers each held-out prompt greedily; then one dense forward
(no cache) over prompt + answer gives, at every position p, the trunk's greedy token for p+1 and
the MTP head's argmax for p+2 (from the normed trunk hidden at p and token p+1). A draft at p is
accepted when the MTP argmax equals the trunk's greedy token at p+2. Draft positions are those a
speculative decoder would draft: p = P-1 .. T-3 for a prompt of length P and a sequence of
length T (the first draft follows the prefill's own token).

    python scripts/demo/evaluate.py --model hybridrt/demo_model --prompts 40 --show 5 --check
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

# sibling scripts, importable only once HERE is on sys.path (set just above)
import make_corpus  # noqa: E402
import train  # noqa: E402


def held_out_prompts(corpus: Path | None, n: int, seed: int = 0) -> list[dict]:
    """-> [{"messages": [... up to the last user turn], "reference": last assistant content}]."""
    if corpus is not None and (corpus / "test.jsonl").is_file():
        docs = make_corpus.read_jsonl(corpus / "test.jsonl")
    else:
        _, docs, _ = make_corpus.build(seed)
    out, seen = [], set()
    for d in docs:
        if "messages" not in d or d["messages"][-1]["role"] != "assistant":
            continue
        msgs = d["messages"][:-1]
        key = json.dumps(msgs)
        if key in seen:
            continue
        seen.add(key)
        out.append({"messages": msgs, "reference": d["messages"][-1]["content"]})
        if len(out) >= n:
            break
    return out


@torch.no_grad()
def greedy_generate(trunk, ids: list[int], max_new: int, eos_ids: list[int]) -> list[int]:
    inp = torch.tensor([ids])
    out = trunk.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new,
                         do_sample=False, eos_token_id=eos_ids, pad_token_id=eos_ids[0])
    return out[0, len(ids):].tolist()


@torch.no_grad()
def dense_predictions(trunk, mtp, seq: list[int]):
    """-> (trunk greedy [T]: token for p+1, mtp argmax [T-1]: token for p+2), dense, no cache."""
    x = torch.tensor([seq])
    hidden = trunk.model(input_ids=x, use_cache=False).last_hidden_state
    trunk_pred = trunk.lm_head(hidden).argmax(-1)[0]
    T = len(seq)
    pos = torch.arange(T - 1)[None]
    mtp_pred = mtp(trunk, x[:, 1:], hidden[:, :-1], pos).argmax(-1)[0]
    return trunk_pred, mtp_pred


def acceptance(trunk, mtp, prompt: list[int], gen: list[int]) -> tuple[int, int, int]:
    """-> (accepted drafts, drafts, positions where the dense trunk disagrees with generate)."""
    seq = prompt + gen
    P, T = len(prompt), len(seq)
    if len(gen) < 2:
        return 0, 0, 0
    trunk_pred, mtp_pred = dense_predictions(trunk, mtp, seq)
    mism = sum(int(trunk_pred[p].item() != seq[p + 1]) for p in range(P - 1, T - 1))
    acc = n = 0
    for p in range(P - 1, T - 2):
        n += 1
        acc += int(mtp_pred[p].item() == trunk_pred[p + 1].item())
    return acc, n, mism


def run_eval(model_dir: Path, corpus: Path | None, n_prompts: int, max_new: int, show: int,
             thinking: bool = False) -> dict:
    tok, trunk, mtp = train.load_checkpoint(model_dir)
    gen_cfg = json.loads((model_dir / "generation_config.json").read_text())
    eos_ids = gen_cfg["eos_token_id"]
    prompts = held_out_prompts(corpus, n_prompts)
    tot_acc = tot_n = tot_mism = 0
    per_prompt = []
    t0 = time.time()
    for i, item in enumerate(prompts):
        text = tok.apply_chat_template(item["messages"], add_generation_prompt=True,
                                       enable_thinking=thinking, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        gen = greedy_generate(trunk, ids, max_new, eos_ids)
        a, n, m = acceptance(trunk, mtp, ids, gen)
        tot_acc, tot_n, tot_mism = tot_acc + a, tot_n + n, tot_mism + m
        per_prompt.append(a / n if n else float("nan"))
        if i < show:
            print("=" * 72)
            print("PROMPT:   " + item["messages"][-1]["content"])
            decoded = tok.decode(gen, skip_special_tokens=False)
            print("MODEL:    " + decoded.replace("\n", "\n          "))
            print("REFERENCE:" + (" " + item["reference"]).replace("\n", "\n          "))
            print(f"(acceptance {a}/{n})")
    rate = tot_acc / max(tot_n, 1)
    res = {"prompts": len(prompts), "drafts": tot_n, "accepted": tot_acc, "acceptance": rate,
           "mean_acceptance_length": 1 + rate, "dense_vs_generate_mismatches": tot_mism,
           "seconds": time.time() - t0, "thinking": thinking}
    print("=" * 72)
    print(json.dumps(res, indent=2))
    return res


# --- load / consistency checks ----------------------------------------------------------------

def _hybridrt_prefill(net, config, ids: list[int], mtp_inputs=None):
    """Run hybridrt's model over one prompt (prefill, fp32) -> (hidden [T, H], logits [T, V],
    mtp logits [T-1, V] or None)."""
    from hybridrt.forward_batch import ForwardBatch
    from hybridrt.statecache import CacheTensors

    T = len(ids)
    bs = 16
    nb = math.ceil(T / bs) + 1
    extra = len(net.mtp.layers) if net.mtp is not None else 0
    cache = CacheTensors.allocate(config, num_blocks=nb, num_slots=1, block_size=bs,
                                  dtype=torch.float32, num_extra_attention_layers=extra)

    def batch_for(tokens, n):
        return ForwardBatch(
            input_ids=torch.tensor(tokens), positions=torch.arange(n),
            cu_seqlens=torch.tensor([0, n]), seq_lens=torch.tensor([n]),
            slot_mapping=torch.arange(n), block_tables=torch.arange(nb)[None],
            state_slots=torch.tensor([0]), has_initial_state=torch.tensor([False]),
            logits_indices=torch.arange(n),
        )

    with torch.no_grad():
        b = batch_for(ids, T)
        hidden = net(b, cache)
        logits = net.compute_logits(hidden)
        mtp_logits = None
        if net.mtp is not None:
            bm = batch_for(ids[1:], T - 1)
            mtp_logits = net.compute_logits(net.mtp_forward(bm.input_ids, hidden[:-1], bm, cache))
    return hidden, logits, mtp_logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def check(model_dir: Path) -> bool:
    import logging

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hybridrt

    ok = True

    def report(name, good, detail=""):
        nonlocal ok
        ok &= bool(good)
        print(f"[{'ok' if good else 'FAIL'}] {name}{': ' + detail if detail else ''}")

    # tokenizer + chat template
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    msgs = [{"role": "user", "content": "What does `json.dumps` do?"}]
    off = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False,
                                  tokenize=False)
    on = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=True,
                                 tokenize=False)
    default = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    base = "<|im_start|>user\nWhat does `json.dumps` do?<|im_end|>\n<|im_start|>assistant\n"
    report("AutoTokenizer", True, f"{type(tok).__name__}, {len(tok)} tokens, eos "
           f"{tok.eos_token!r}={tok.eos_token_id}, pad {tok.pad_token!r}={tok.pad_token_id}")
    report("chat template enable_thinking=False", off == base + "<think>\n\n</think>\n\n",
           repr(off[-40:]))
    report("chat template enable_thinking=True", on == base, repr(on[-30:]))
    report("chat template default = non-thinking", default == off)
    ids = tok(off)["input_ids"]
    report("special tokens are single ids", tok.convert_ids_to_tokens(ids[:1]) == ["<|im_start|>"]
           and "<think>" in tok.convert_ids_to_tokens(ids) and tok.decode(ids) == off)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    samples = [off, on, "  def f(x, /, *, key=None) -> dict[str, int]:\n\treturn {'a': 1}\r\n",
               "Ünïcödé — naïve café 123456789 ½ 😀", "json.dumps(obj, *, skipkeys=False)"]
    same = all(tok(t, add_special_tokens=False)["input_ids"] == raw.encode(t).ids
               and tok.decode(raw.encode(t).ids) == t for t in samples)
    report("AutoTokenizer == tokenizers.Tokenizer(tokenizer.json), round trip", same)

    # our trainer's loader (transformers trunk + MTP head) vs hybridrt
    _, trunk, mtp = train.load_checkpoint(model_dir)
    prompt = off + ("Serialize ``obj`` to a JSON formatted ``str``. If ``skipkeys`` is true then "
                    "``dict`` keys that are not basic types (``str``, ``int``, ``float``, "
                    "``bool``, ``None``) will be skipped instead of raising a ``TypeError``."
                    "<|im_end|>\n") * 3
    ids = tok(prompt)["input_ids"]
    x = torch.tensor([ids])
    with torch.no_grad():
        hidden = trunk.model(input_ids=x, use_cache=False).last_hidden_state
        ref_logits = trunk.lm_head(hidden)[0].float()
        ref_mtp = mtp(trunk, x[:, 1:], hidden[:, :-1],
                      torch.arange(len(ids) - 1)[None])[0].float()
    net, config, _ = hybridrt.load_model(str(model_dir), dtype=torch.float32)
    report("hybridrt.load_model", net.mtp is not None,
           f"{config.num_hidden_layers} layers "
           f"{config.layer_types.count('full_attention')} attention, "
           f"vocab {config.vocab_size}, eos {config.eos_token_ids}, "
           f"mtp layers {config.mtp_num_hidden_layers}")
    _, logits, mtp_logits = _hybridrt_prefill(net, config, ids)
    r = _rel(logits, ref_logits)
    report("hybridrt vs transformers logits (fp32)", r < 1e-4,
           f"max rel diff {r:.2e} over {len(ids)} tokens")
    r = _rel(mtp_logits, ref_mtp)
    report("hybridrt MTP modules vs training MTP head (fp32)", r < 1e-4, f"max rel diff {r:.2e}")

    # transformers' own loaders
    records = []

    class _H(logging.Handler):
        def emit(self, rec):
            records.append(rec.getMessage())

    tl = logging.getLogger("transformers")
    h = _H()
    tl.addHandler(h)
    try:
        auto = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    finally:
        tl.removeHandler(h)
    with torch.no_grad():
        auto_logits = auto(input_ids=x).logits[0].float()
    r = _rel(auto_logits, ref_logits)
    notes = [m.splitlines()[0][:160] for m in records
             if "mtp" in m.lower() or "unexpected" in m.lower()
             or "missing" in m.lower() or "not used" in m.lower()]
    report("AutoModelForCausalLM.from_pretrained", r < 1e-5,
           f"class {type(auto).__name__}, rel diff {r:.2e}; messages: {notes or 'none'}")
    tied = auto.lm_head.weight.data_ptr() == auto.model.embed_tokens.weight.data_ptr()
    report("transformers ties lm_head to embed_tokens", tied)

    # sizes
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    print("files: " + ", ".join(f"{p.name} {p.stat().st_size / 1e6:.2f} MB" for p in files)
          + f"; total {total / 1e6:.1f} MB")
    return ok


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Evaluate the hybridrt demo checkpoint.")
    ap.add_argument("--model", type=Path, default=REPO / "hybridrt" / "demo_model")
    ap.add_argument("--corpus", type=Path, default=REPO / "build" / "demo" / "corpus",
                    help="corpus dir with test.jsonl (rebuilt deterministically if missing)")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--show", type=int, default=5)
    ap.add_argument("--thinking", action="store_true", help="prompt with enable_thinking=True")
    ap.add_argument("--check", action="store_true", help="also run the load/consistency checks")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ok = True
    if args.check:
        ok = check(args.model)
    if args.prompts > 0:
        run_eval(args.model, args.corpus, args.prompts, args.max_new_tokens, args.show,
                 args.thinking)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
