"""What llama.cpp's converter (``conversion/qwen.py``: ``Qwen3NextModel.modify_tensors``,
``_LinearAttentionVReorderBase``, ``_QwenMtpMixin``, ``Qwen2MoeModel.modify_tensors``) did to
each Qwen3.5 tensor (``qwen35``, and ``qwen35moe``'s sparse MoE blocks), and its inverse: our
parameter name -> ``Source`` (the GGUF tensor, the row or column order to take, the value
transform).

The converter:

- renames (``blk.{i}.attn_qkv`` for ``in_proj_qkv`` ...; MTP layer j becomes block
  ``num_hidden_layers + j``, its ``fc`` / ``pre_fc_norm_*`` / ``norm`` ``nextn.eh_proj`` /
  ``nextn.enorm``, ``nextn.hnorm`` / ``nextn.shared_head_norm``);
- with fewer key than value heads, moves the value heads from grouped order (by key head) to
  tiled order in ``in_proj_qkv``'s V rows, ``in_proj_z``, ``in_proj_a``, ``in_proj_b``,
  ``A_log``, ``dt_bias``, the conv's V channels and ``out_proj``'s columns;
- stores ``ssm_a = -exp(A_log)``, the zero-centred RMSNorm weights plus one (every norm but
  the gated ``linear_attn.norm``) and the conv weight squeezed to [channels, kernel];
- in an MoE block, stacks the experts' ``gate_proj`` / ``up_proj`` / ``down_proj`` into
  ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` [E, ...] (with ``--fuse-gate-up-exps``
  gate and up as one ``ffn_gate_up_exps`` [E, 2I, H], gate rows first: our own layout), and
  renames the router ``mlp.gate`` ``ffn_gate_inp``, the shared expert ``ffn_*_shexp`` and its
  gate ``ffn_gate_inp_shexp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrt.config import ModelConfig

_LAYER = {  # our name inside a decoder layer -> GGUF name inside blk.{i}
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
_MOE = {  # an MoE layer's parameters but the routed experts'
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
        "output_norm.weight", "lm_head.weight": "output.weight"}
_MTP_TOP = {"mtp.fc.weight": "nextn.eh_proj.weight",
            "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
            "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
            "mtp.norm.weight": "nextn.shared_head_norm.weight"}


@dataclass(frozen=True)
class Source:
    """Where our parameter comes from: GGUF tensor ``name``; ``rows`` / ``cols``: the order to
    take its rows / columns in (index tensors; None: as stored); ``value``: "norm" (minus
    the one the converter added), "a_log" (log(-ssm_a)) or None; ``unsqueeze``: the conv
    weight's kernel axis back (dim 1). A routed expert's weight is matrix ``expert`` of
    stacked tensors of ``experts`` matrices: ``name``'s, followed by ``also``'s rows when
    set (an expert's up after its gate)."""

    name: str
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    value: str | None = None
    unsqueeze: bool = False
    expert: int | None = None
    experts: int = 0
    also: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The GGUF tensors this parameter is read from."""
        return (self.name,) if self.also is None else (self.name, self.also)


def grouped_order(num_k: int, num_v: int, head_dim: int) -> torch.Tensor:
    """The inverse of the converter's ``_reorder_v_heads``: index i of the grouped (Hugging
    Face) order -> its position in the tiled (GGUF) order, for ``num_v`` heads of
    ``head_dim`` in ``num_k`` groups."""
    r = num_v // num_k
    return torch.arange(num_v * head_dim).view(r, num_k, head_dim).permute(1, 0, 2).reshape(-1)


def _experts(prefix: str, block: int, n: int, fused: bool) -> dict[str, Source]:
    """The routed experts of MoE block ``blk.{block}`` (``fused``: gate and up stacked as one
    ``ffn_gate_up_exps``)."""
    blk = f"blk.{block}"
    out = {}
    for e in range(n):
        gate_up = Source(f"{blk}.ffn_gate_up_exps.weight", expert=e, experts=n) if fused else \
            Source(f"{blk}.ffn_gate_exps.weight", expert=e, experts=n,
                   also=f"{blk}.ffn_up_exps.weight")
        out[f"{prefix}.mlp.experts.{e}.gate_up_proj.weight"] = gate_up
        out[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = Source(
            f"{blk}.ffn_down_exps.weight", expert=e, experts=n)
    return out


def sources(config: ModelConfig, with_mtp: bool, fused_experts: bool = False
            ) -> dict[str, Source]:
    """Our parameter name -> its Source, for every parameter a model of ``config`` has (the
    MTP head's with ``with_mtp``; an MoE model's experts stacked as the converter writes
    them, ``fused_experts``: gate and up in one tensor)."""
    c = config
    moe = c.num_experts > 0
    reorder = c.linear_num_key_heads != c.linear_num_value_heads
    v_rows = v_heads = qkv_rows = None
    if reorder:
        v_rows = grouped_order(c.linear_num_key_heads, c.linear_num_value_heads,
                               c.linear_value_head_dim)
        v_heads = grouped_order(c.linear_num_key_heads, c.linear_num_value_heads, 1)
        qk = 2 * c.linear_key_dim
        qkv_rows = torch.cat([torch.arange(qk), qk + v_rows])
    order = {"linear_attn.in_proj_qkv.weight": ("rows", qkv_rows),
             "linear_attn.conv1d.weight": ("rows", qkv_rows),
             "linear_attn.in_proj_z.weight": ("rows", v_rows),
             "linear_attn.in_proj_a.weight": ("rows", v_heads),
             "linear_attn.in_proj_b.weight": ("rows", v_heads),
             "linear_attn.A_log": ("rows", v_heads),
             "linear_attn.dt_bias": ("rows", v_heads),
             "linear_attn.out_proj.weight": ("cols", v_rows)}

    def layer(prefix: str, block: int, kind: str) -> dict[str, Source]:
        out = {}
        for ours, theirs in (_LAYER | _MOE).items():
            mixer = ours.split(".", 1)[0]
            if mixer in ("self_attn", "linear_attn") and mixer != kind or \
                    mixer == "mlp" and (ours in _MOE) != moe:
                continue
            axis, index = order.get(ours, (None, None))
            value = ("a_log" if ours.endswith("A_log") else
                     "norm" if ours.endswith("norm.weight") and mixer != "linear_attn" else None)
            out[f"{prefix}.{ours}"] = Source(
                f"blk.{block}.{theirs}", rows=index if axis == "rows" else None,
                cols=index if axis == "cols" else None, value=value,
                unsqueeze=ours.endswith("conv1d.weight"))
        if moe:
            out.update(_experts(prefix, block, c.num_experts, fused_experts))
        return out

    out = {}
    for ours, theirs in _TOP.items():
        if ours == "lm_head.weight" and c.tie_word_embeddings:
            continue
        out[ours] = Source(theirs, value="norm" if ours.endswith("norm.weight") else None)
    for i, t in enumerate(c.layer_types):
        out.update(layer(f"model.layers.{i}",
                         i, "linear_attn" if t == "linear_attention" else "self_attn"))
    if with_mtp:
        n = c.num_hidden_layers
        for ours, theirs in _MTP_TOP.items():
            out[ours] = Source(f"blk.{n}.{theirs}", value=None if ours == "mtp.fc.weight"
                               else "norm")
        for j in range(c.mtp_num_hidden_layers):
            out.update(layer(f"mtp.layers.{j}", n + j, "self_attn"))
    return out


def is_mtp_tensor(name: str, config: ModelConfig) -> bool:
    """Whether GGUF tensor ``name`` belongs to the MTP (nextn) blocks."""
    if not name.startswith("blk."):
        return False
    return int(name.split(".")[1]) >= config.num_hidden_layers


def restore(t: torch.Tensor, src: Source) -> torch.Tensor:
    """A float tensor as the converter read it: ``src``'s order, value and shape undone."""
    if src.rows is not None:
        t = t.index_select(0, src.rows)
    if src.cols is not None:
        t = t.index_select(1, src.cols)
    if src.value == "norm":
        t = t - 1
    elif src.value == "a_log":
        t = torch.log(-t.double()).to(t.dtype)
    if src.unsqueeze:
        t = t.unsqueeze(1)
    return t


def stored_shape(shape: tuple[int, ...], src: Source) -> tuple[int, ...]:
    """The GGUF (torch-order) shape of each tensor a parameter of ``shape`` is read from (a
    stacked expert tensor's whole shape)."""
    if src.unsqueeze:
        return (shape[0], shape[2])
    if src.expert is not None:
        rows = shape[0] // len(src.names)
        return (src.experts, rows, *shape[1:])
    return shape
