"""The numbers of docs/scale.md: how a Qwen3.5 dense model splits over tensor-parallel ranks
(heads, channels, state and KV per rank, all-reduce bytes per token) and what a disaggregated
prefill moves. Arithmetic on the published configs, nothing measured:

    python scripts/tp_sizes.py
"""

from __future__ import annotations

# the text_config fields that matter here (Qwen/Qwen3.5-0.8B and Qwen/Qwen3.5-27B)
MODELS = {
    "0.8B": {"hidden": 1024, "inter": 3584, "layers": 24, "heads": 8, "kv_heads": 2,
             "head_dim": 256, "lin_k_heads": 16, "lin_v_heads": 16, "lin_k_dim": 128,
             "lin_v_dim": 128, "conv_kernel": 4, "vocab": 248320, "tied": True},
    "27B": {"hidden": 5120, "inter": 17408, "layers": 64, "heads": 24, "kv_heads": 4,
            "head_dim": 256, "lin_k_heads": 16, "lin_v_heads": 48, "lin_k_dim": 128,
            "lin_v_dim": 128, "conv_kernel": 4, "vocab": 248320, "tied": False},
}
BF16, FP32 = 2, 4
MiB = 2**20


def sizes(m: dict, tp: int) -> dict:
    n_attn = m["layers"] // 4  # full attention every fourth layer
    n_gdn = m["layers"] - n_attn
    conv_dim = 2 * m["lin_k_heads"] * m["lin_k_dim"] + m["lin_v_heads"] * m["lin_v_dim"]
    kv_per_rank = max(1, m["kv_heads"] // tp)  # below one head a rank: heads replicated
    out = {
        "gdn key heads / value heads": f"{m['lin_k_heads'] / tp:g} / {m['lin_v_heads'] / tp:g}",
        "conv channels": conv_dim // tp,
        "attention q heads / kv heads": f"{m['heads'] / tp:g} / {kv_per_rank}"
                                        + (" (replicated)" if tp > m["kv_heads"] else ""),
        "mlp columns": m["inter"] // tp,
        "recurrent state a slot, MiB": n_gdn * m["lin_v_heads"] // tp * m["lin_k_dim"]
        * m["lin_v_dim"] * FP32 / MiB,
        "conv state a slot, MiB": n_gdn * (m["conv_kernel"] - 1) * conv_dim // tp * BF16 / MiB,
        "KV a token, KiB": n_attn * 2 * kv_per_rank * m["head_dim"] * BF16 / 1024,
        "weights, GiB": weights(m) * BF16 / tp / 2**30,
    }
    # two all-reduces a layer (after the mixer's output projection, after the MLP's down
    # projection) and one for the vocabulary-parallel embedding; each a token's hidden state
    n_ar = 2 * m["layers"] + 1
    payload = m["hidden"] * BF16
    one = tp == 1  # nothing to reduce
    out["all-reduces a forward"] = "-" if one else n_ar
    out["all-reduce payload a token, KiB"] = "-" if one else n_ar * payload / 1024
    out["ring traffic a rank a token, KiB"] = "-" if one else \
        n_ar * payload * 2 * (tp - 1) / tp / 1024
    return out


def weights(m: dict) -> int:
    h, conv_dim = m["hidden"], 2 * m["lin_k_heads"] * m["lin_k_dim"] \
        + m["lin_v_heads"] * m["lin_v_dim"]
    v_dim = m["lin_v_heads"] * m["lin_v_dim"]
    gdn = h * conv_dim + h * v_dim + 2 * h * m["lin_v_heads"] + v_dim * h + conv_dim * 4
    q = m["heads"] * m["head_dim"]
    attn = h * 2 * q + 2 * h * m["kv_heads"] * m["head_dim"] + q * h
    mlp = 3 * h * m["inter"]
    n_attn = m["layers"] // 4
    emb = m["vocab"] * h * (1 if m["tied"] else 2)
    return (m["layers"] - n_attn) * gdn + n_attn * attn + m["layers"] * mlp + emb


def transfer(m: dict, prompt: int) -> dict:
    """What a disaggregated prefill hands the decode side for one ``prompt``-token request:
    the KV blocks (target + MTP layer), one GDN state slot, with the MTP the hidden state."""
    s = sizes(m, 1)
    n_attn = m["layers"] // 4
    kv = prompt * s["KV a token, KiB"] * 1024 * (n_attn + 1) / n_attn
    state = (s["recurrent state a slot, MiB"] + s["conv state a slot, MiB"]) * MiB
    return {"KV, MiB": kv / MiB, "GDN state, MiB": state / MiB,
            "total, MiB": (kv + state + m["hidden"] * BF16) / MiB}


def main() -> None:
    for name, m in MODELS.items():
        print(f"\n## {name}: {weights(m) / 1e9:.2f}B parameters")
        tps = [1, 2, 4, 8] if name == "27B" else [1, 2]
        rows = {tp: sizes(m, tp) for tp in tps}
        print("| per rank | " + " | ".join(f"TP={tp}" for tp in tps) + " |")
        print("| --- |" + " ---: |" * len(tps))
        for key in rows[1]:
            vals = [rows[tp][key] for tp in tps]
            print(f"| {key} | " + " | ".join(
                f"{v:,.2f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int)
                else v for v in vals) + " |")
        print("\n| prompt tokens | KV, MiB | GDN state, MiB | total, MiB |")
        print("| ---: | ---: | ---: | ---: |")
        for prompt in (512, 4096, 32768):
            t = transfer(m, prompt)
            print(f"| {prompt:,} | {t['KV, MiB']:,.1f} | {t['GDN state, MiB']:,.1f} | "
                  f"{t['total, MiB']:,.1f} |")


if __name__ == "__main__":
    main()
