"""A copy-heavy workload for ``hybridrt bench spec --workload copy``: outputs that repeat
spans of their prompts (an agent rewriting a file, an answer quoting its sources), where
prompt-lookup drafts pay.

With a chat template each prompt hands the model a slice of a Python source file (default:
this package's ``sampler.py``) and asks for it back with one name changed; a model that
follows copies the slice. Without one each prompt is a document of distinct random token ids
and then a few of its tokens again, from a random place: a model that copies goes on from
there. The bench reports the acceptance it measured either way.

Random weights copy nothing, so ``make_copy_model`` writes a checkpoint of any Qwen3.5 shape
(the 0.8B one by default) whose weights are random except for a two-layer induction head, the
circuit trained models copy with: the first GDN layer, its state reset every step (a large
decay) and its value taken one token back through the short convolution, writes the previous
token into a second half of the residual stream; the first attention layer's query reads the
current token, its key the previous one (the RoPE dimensions left empty), its value the token
itself, sharply (the q / k norms scaled), so each position attends to the one after the
current token's latest earlier occurrence and writes that token's embedding, which the tied
head reads. Every other layer's output projections are scaled by 1e-3. The speed is the
shape's (no kernel looks at the values); the acceptance is what the drafter earns on a model
that copies."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

DEFAULT_SOURCE = Path(__file__).resolve().parents[1] / "sampler.py"
ASK = ("Here is part of a Python file:\n\n```python\n{code}\n```\n\nRewrite it exactly as it "
       "is, with every `self` renamed to `this`. Reply with the code only.")


def copy_prompts(llm, n: int = 8, lines: int = 24, source: str | Path | None = None,
                 span: int = 256, seed: int = 0) -> list:
    """``n`` copy prompts: chat-formatted slices of ``lines`` lines of ``source`` when the model
    has a chat template, else ``span`` distinct random token ids and then 4 of them again from
    a random place in the first half."""
    tok = llm.tokenizer
    if tok is not None and getattr(tok, "chat_template", None):
        text = Path(source or DEFAULT_SOURCE).read_text().splitlines()
        step = max(1, (len(text) - lines) // max(1, n))
        slices = ["\n".join(text[i * step:i * step + lines]) for i in range(n)]
        return [llm.apply_chat_template([{"role": "user", "content": ASK.format(code=c)}])
                for c in slices]
    g = torch.Generator().manual_seed(seed)
    vocab = llm.config.vocab_size
    low = min(3, vocab - 1)
    span = min(span, vocab - low)
    out = []
    for _ in range(n):
        doc = (torch.randperm(vocab - low, generator=g)[:span] + low).tolist()
        at = int(torch.randint(0, max(1, span // 2 - 4), (1,), generator=g))
        out.append(doc + doc[at:at + 4])
    return out


def _fit(features: torch.Tensor, target: torch.Tensor, ridge: float = 1e-3) -> torch.Tensor:
    """The [out, in] weight mapping ``features`` rows to ``target`` rows, ridge-regularised
    (least squares alone gives huge weights on these low-rank features, which bf16 ruins)."""
    g = features.T @ features
    g += ridge * g.diagonal().mean() * torch.eye(g.shape[0])
    return torch.linalg.solve(g, features.T @ target).T.contiguous()


def copy_state_dict(config, seed: int = 0, dtype: torch.dtype = torch.float32,
                    strength: float = 3.0, sharpness: float = 3.0,
                    quiet: float = 1e-3) -> dict[str, torch.Tensor]:
    """Weights (our naming) for ``config`` that copy (module docstring): random, then the
    embedding, the first GDN layer, the first attention layer and the norms they read set, the
    other layers' output projections scaled by ``quiet``. ``strength``: the copied token's
    embedding against the current one's in the residual; ``sharpness``: the q / k norm scale
    (attention logits up to ``sqrt(head_dim) * sharpness**2``)."""
    from hybridrt.bench.fixtures import random_state_dict
    from hybridrt.kernels.norm import gated_rms_norm, rms_norm

    sd = random_state_dict(config, seed, torch.float32, with_mtp=True)
    g = torch.Generator().manual_seed(seed + 1)
    H, V, eps = config.hidden_size, config.vocab_size, config.rms_norm_eps
    kd, vd = config.linear_key_dim, config.linear_value_dim
    nv, dv = config.linear_num_value_heads, config.linear_value_head_dim
    K = config.linear_conv_kernel_dim
    types = list(config.layer_types)
    gdn, attn = types.index("linear_attention"), types.index("full_attention")
    if gdn > attn:
        raise ValueError("the copy model needs a GDN layer before the first attention layer")
    # the residual: [a constant 3 | the token (A) | the token before (B)]
    a = (H - 1) // 2
    A, B = slice(1, 1 + a), slice(1 + a, 1 + 2 * a)
    emb = torch.zeros(V, H)
    emb[:, 0] = 3.0
    emb[:, A] = torch.randn(V, a, generator=g)
    sd["model.embed_tokens.weight"] = emb
    sd["model.norm.weight"] = torch.zeros(H)
    n = min(V, 4096)
    ids = torch.randperm(V, generator=g)[:n]
    before = torch.randint(0, V, (n,), generator=g)

    p = f"model.layers.{gdn}."
    sd[p + "input_layernorm.weight"] = torch.zeros(H)
    rk, rv = torch.zeros(kd, H), torch.zeros(vd, H)
    rk[:, A] = torch.randn(kd, a, generator=g) * (0.5 / math.sqrt(a))
    rv[:, A] = torch.randn(vd, a, generator=g) * (0.5 / math.sqrt(a))
    sd[p + "linear_attn.in_proj_qkv.weight"] = torch.cat([rk, rk, rv])
    conv = torch.zeros(2 * kd + vd, 1, K)
    conv[:2 * kd, 0, K - 1] = 1.0  # q and k: this token
    conv[2 * kd:, 0, K - 2] = 1.0  # v: the token before
    sd[p + "linear_attn.conv1d.weight"] = conv
    z = 4.0
    wz, wb = torch.zeros(vd, H), torch.zeros(nv, H)
    wz[:, 0], wb[:, 0] = z / 3.0, 10.0 / 3.0  # gate silu(4), beta sigmoid(10)
    sd[p + "linear_attn.in_proj_z.weight"] = wz
    sd[p + "linear_attn.in_proj_b.weight"] = wb
    sd[p + "linear_attn.in_proj_a.weight"] = torch.zeros(nv, H)
    sd[p + "linear_attn.A_log"] = torch.full((nv,), 5.0)  # decay exp(-148 ln 2): reset a step
    sd[p + "linear_attn.dt_bias"] = torch.zeros(nv)
    sd[p + "linear_attn.norm.weight"] = torch.ones(dv)
    v = F.silu(rms_norm(emb[ids], torch.zeros(H), eps) @ rv.T).view(n, nv, dv)
    feats = gated_rms_norm(v, torch.full_like(v, z), torch.ones(dv), eps).reshape(n, vd)
    target = torch.zeros(n, H)
    target[:, B] = emb[ids][:, A]
    sd[p + "linear_attn.out_proj.weight"] = _fit(feats, target)

    p = f"model.layers.{attn}."
    sd[p + "input_layernorm.weight"] = torch.zeros(H)
    nh, nkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    rot = int(D * config.partial_rotary_factor)
    q = torch.randn(D - rot, a, generator=g)
    wq = torch.zeros(nh, 2 * D, H)
    wq[:, rot:D, A] = q
    wq[:, D:, 0] = 10.0 / 3.0  # output gate sigmoid(10)
    wk = torch.zeros(nkv, D, H)
    wk[:, rot:, B] = q
    wv = torch.zeros(nkv, D, H)
    wv[:, :, A] = torch.randn(nkv, D, a, generator=g) / math.sqrt(a)
    sd[p + "self_attn.q_proj.weight"] = wq.reshape(nh * 2 * D, H)
    sd[p + "self_attn.k_proj.weight"] = wk.reshape(nkv * D, H)
    sd[p + "self_attn.v_proj.weight"] = wv.reshape(nkv * D, H)
    sd[p + "self_attn.q_norm.weight"] = torch.full((D,), sharpness - 1.0)
    sd[p + "self_attn.k_norm.weight"] = torch.full((D,), sharpness - 1.0)
    res = emb[ids].clone()
    res[:, B] = emb[before][:, A]
    vals = (rms_norm(res, torch.zeros(H), eps) @ wv.reshape(nkv * D, H).T).view(n, nkv, D)
    feats = vals[:, torch.arange(nh) // (nh // nkv)].reshape(n, nh * D)
    target = torch.zeros(n, H)
    target[:, A] = strength * emb[ids][:, A]
    sd[p + "self_attn.o_proj.weight"] = _fit(feats, target)

    keep = (f"model.layers.{gdn}.linear_attn.", f"model.layers.{attn}.self_attn.")
    for name in sd:
        if name.startswith("model.layers.") and not name.startswith(keep) and name.endswith(
                ("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            sd[name] = sd[name] * quiet
    return {k: t.to(dtype) for k, t in sd.items()}


def make_copy_model(directory: str | Path, text_config: dict | None = None, seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a copy model (``copy_state_dict``) of ``text_config`` (default: the 0.8B shape)
    to ``directory`` in the published layout, without a tokenizer (its prompts are token
    ids: ``copy_prompts``)."""
    from hybridrt.bench.fixtures import QWEN35_08B_TEXT_CONFIG, write_random_checkpoint
    from hybridrt.config import ModelConfig

    cfg = text_config or QWEN35_08B_TEXT_CONFIG
    sd = copy_state_dict(ModelConfig.from_dict(cfg), seed, dtype)
    return write_random_checkpoint(directory, cfg, state_dict=sd, dtype=dtype)
