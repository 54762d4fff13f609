"""The two layouts of an MoE checkpoint's experts, and ours.

- per expert: ``mlp.experts.{e}.gate_proj.weight`` [I, H], ``up_proj.weight`` [I, H],
  ``down_proj.weight`` [H, I] (the published Qwen3.5 MoE checkpoints);
- fused: ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first) and ``mlp.experts.down_proj``
  [E, H, I] (transformers' in-memory form, and what ``save_pretrained`` writes);
- ours (``hybridrt/moe_block.py``): ``mlp.experts.{e}.gate_up_proj.weight`` [2I, H] and
  ``mlp.experts.{e}.down_proj.weight`` [H, I].

``adapt_expert_tensors`` makes a checkpoint of either layout read as ours at load, one expert
at a time (a fused tensor's expert is read through its memory-mapped slice, never the whole
tensor); ``to_fused`` and ``to_per_expert`` write our state dict in either layout.
"""

from __future__ import annotations

import re

import torch

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_SPLIT = re.compile(r"^(.*\.mlp\.experts\.\d+)\.(gate_proj|up_proj)\.weight$")
_OURS = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_up_proj|down_proj)\.weight$")


class _Derived:
    """Stands in for a ``safe_open`` handle for one tensor made from stored ones: answers
    ``get_slice(_).get_shape()`` / ``get_dtype()`` and ``get_tensor(_)`` as the loader asks."""

    def __init__(self, shape: list[int], dtype: str, read):
        self.shape, self.dtype, self.read = shape, dtype, read

    def get_slice(self, _name):
        return self

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype

    def get_tensor(self, _name) -> torch.Tensor:
        return self.read()


def adapt_expert_tensors(handles: dict, file_of: dict) -> None:
    """In place: the loader's {our name: (handle, stored name)} of a checkpoint with fused or
    per-expert experts -> entries under our names (``<stored>[e]`` / ``<stored gate>+up`` as
    their stored names, in ``file_of`` too). A fused tensor that is not 3D, or a gate without
    its up (or the reverse), is left as it is: the loader reports it."""
    for canon in [c for c in handles if _FUSED.match(c)]:
        h, raw = handles[canon]
        sl = h.get_slice(raw)
        shape = sl.get_shape()
        if len(shape) != 3:
            continue
        prefix, part = _FUSED.match(canon).groups()
        del handles[canon]
        for e in range(shape[0]):
            name = f"{raw}[{e}]"
            handles[f"{prefix}.{e}.{part}.weight"] = (
                _Derived(shape[1:], sl.get_dtype(), lambda h=h, raw=raw, e=e: h.get_slice(raw)[e]),
                name)
            file_of[name] = file_of[raw]
    pairs: dict[str, dict[str, str]] = {}
    for canon in handles:
        m = _SPLIT.match(canon)
        if m:
            pairs.setdefault(m.group(1), {})[m.group(2)] = canon
    for prefix, parts in pairs.items():
        if len(parts) != 2:
            continue
        (hg, rg), (hu, ru) = handles[parts["gate_proj"]], handles[parts["up_proj"]]
        sg, su = hg.get_slice(rg), hu.get_slice(ru)
        gshape, ushape = sg.get_shape(), su.get_shape()
        # a gate and up of different shapes: a shape the loader reports as mismatched
        shape = [gshape[0] + ushape[0], *gshape[1:]] if gshape[1:] == ushape[1:] else \
            [gshape[0] + ushape[0], -1]
        name = f"{rg}+up_proj"
        del handles[parts["gate_proj"]], handles[parts["up_proj"]]
        handles[f"{prefix}.gate_up_proj.weight"] = (
            _Derived(shape, sg.get_dtype(), lambda hg=hg, rg=rg, hu=hu, ru=ru: torch.cat(
                [hg.get_tensor(rg), hu.get_tensor(ru)])), name)
        file_of[name] = file_of[rg]


def to_fused(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> the fused layout (transformers' ``Qwen3_5MoeForCausalLM`` names)."""
    out, experts = {}, {}
    for name, t in state_dict.items():
        m = _OURS.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
    for (prefix, part), per in experts.items():
        out[f"{prefix}.{part}"] = torch.stack([per[e] for e in range(len(per))])
    return out


def to_per_expert(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> the per-expert layout (gate_up split into gate_proj and up_proj)."""
    out = {}
    for name, t in state_dict.items():
        m = _OURS.match(name)
        if m is None or m.group(3) == "down_proj":
            out[name] = t
            continue
        gate, up = t.chunk(2, dim=0)
        base = f"{m.group(1)}.{m.group(2)}"
        out[f"{base}.gate_proj.weight"] = gate.contiguous()
        out[f"{base}.up_proj.weight"] = up.contiguous()
    return out
