"""``load_gguf_model``: a GGUF file -> (our model, its config, the file's path), as
``hybridrt.loader.load_model`` loads a checkpoint directory.

Everything is checked before any weight is read: the header, the architecture, the config,
every tensor's presence, shape and type (``GGUFError``, one line). Float tensors keep the
file's pages where no transform or dtype change applies; quantized ones map onto hybridrt's
formats per tensor (``tensors``), so a mixed file keeps each tensor's precision. A routed
expert's weight is its matrix of the stacked expert tensors (``GGUFFile.matrix``: a view of
the same pages), gate and up rows concatenated.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from hybridrt.gguf import blocks, names, repack, tensors
from hybridrt.gguf.config import model_config
from hybridrt.gguf.reader import GGUFError, GGUFFile
from hybridrt.kernels import quant
from hybridrt.kernels.memory import release_pages

_FILE_TYPE_DTYPES = {0: torch.float32, 1: torch.float16, 32: torch.bfloat16}  # general.file_type


def auto_dtype(f: GGUFFile, device: torch.device) -> torch.dtype:
    """``dtype="auto"``: F32 / F16 / BF16 files load in that dtype, quantized ones in bfloat16;
    on CUDA float32 becomes bfloat16 (as for safetensors)."""
    dtype = _FILE_TYPE_DTYPES.get(int(f.get("general.file_type", -1)))
    if dtype is None:
        types = {tensors.type_name(t) for n, t in f.tensors.items() if n.endswith(".weight")
                 and len(t.shape) == 2}
        dtype = {frozenset({"F32"}): torch.float32, frozenset({"F16"}): torch.float16}.get(
            frozenset(types), torch.bfloat16)
    if device.type == "cuda" and dtype == torch.float32:
        return torch.bfloat16
    return dtype


def _check(f: GGUFFile, expected: dict, srcs: dict, config, with_mtp: bool) -> None:
    problems, seen = [], set()
    for name, shape in expected.items():  # a stacked expert tensor is checked once
        src = srcs[name]
        want = names.stored_shape(shape, src)
        for stored in src.names:
            if stored in seen:
                continue
            seen.add(stored)
            t = f.tensors.get(stored)
            if t is None:
                problems.append(f"tensor {stored} is missing")
            elif GGUFFile.shape(t) != want:
                problems.append(f"tensor {stored} has shape {list(GGUFFile.shape(t))}, "
                                f"expected {list(want)}")
            elif not tensors.supported(t):
                problems.append(f"tensor {stored} has type {tensors.type_name(t)}, which "
                                f"hybridrt does not load (it loads "
                                f"{', '.join(tensors.FLOAT_TYPES)}, "
                                f"{', '.join(tensors.QUANT_FORMATS)})")
        kinds = {tensors.type_name(f.tensors[n]) for n in src.names if n in f.tensors}
        if len(kinds) > 1 and src.expert == 0:
            problems.append(f"tensors {' and '.join(src.names)} hold one weight (the experts' "
                            f"gate and up) in different types ({', '.join(sorted(kinds))}); "
                            f"hybridrt needs one")
    used = {n for s in srcs.values() for n in s.names}
    for name in f.tensors:
        if name in used or (not with_mtp and names.is_mtp_tensor(name, config)):
            continue
        problems.append(f"tensor {name} is not one of a {f.arch} model's")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise GGUFError(f"{f.path}: {problems[0]}{more}")


def _in_order(src: names.Source, q: torch.Tensor, *groups: torch.Tensor):
    """Values q [N, G, ...] and their per-group tensors [N, G] with ``src``'s rows and columns
    put back in order (columns only in whole groups of 32)."""
    if src.rows is not None:
        q, groups = q.index_select(0, src.rows), [g.index_select(0, src.rows) for g in groups]
    if src.cols is not None:
        blocks = src.cols.view(-1, quant.GROUP)
        if (blocks - blocks[:, :1] != torch.arange(quant.GROUP)).any() or (
                blocks[:, 0] % quant.GROUP).any():
            raise GGUFError(f"{src.name}: value heads whose size is not a multiple of 32 "
                            f"cannot be put back in order in a quantized tensor")
        first = blocks[:, 0] // quant.GROUP
        q, groups = q.index_select(1, first), [g.index_select(1, first) for g in groups]
    return q, *groups


def _parts(f: GGUFFile, src: names.Source) -> list:
    """The GGUF tensors a parameter is read from, whose rows it concatenates (a routed
    expert: its matrix of each stacked tensor, a view of the same pages)."""
    parts = [f.tensors[n] for n in src.names]
    if src.expert is not None:
        parts = [GGUFFile.matrix(t, src.expert) for t in parts]
    return parts


def _rows(*decoded: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The parts' decoded tensors, each concatenated along the rows."""
    return tuple(torch.cat(ts) if len(ts) > 1 else ts[0] for ts in zip(*decoded))


def _packed(parts: list, src: names.Source) -> quant.PackedWeight:
    """A quantized GGUF weight in hybridrt's format for its type (``tensors``; in one pass of
    compiled code where ``repack`` takes it)."""
    if len(parts) == 1:
        fast = repack.packed(parts[0], GGUFFile.shape(parts[0]), src)
        if fast is not None:
            return fast
    kind = tensors.type_name(parts[0])
    fmt = tensors.QUANT_FORMATS[kind]
    if fmt == "int8":
        q, d = _in_order(src, *_rows(*(blocks.int8_groups(t, GGUFFile.shape(t))
                                       for t in parts)))
        if (q == -128).any():
            raise GGUFError(f"{src.name}: {kind} value -128 (llama.cpp never writes it; "
                            f"hybridrt's int8 kernels take -127..127)")
        return tensors.int8_weight(q, d)
    if kind in tensors.NIBBLE_TYPES:
        q, step, minimum = _in_order(src, *_rows(*(blocks.nibble_groups(t, GGUFFile.shape(t))
                                                   for t in parts)))
        if (minimum >= 0).all():
            return tensors.int4_weight(q, step, minimum)
    if kind == "Q6_K":
        return tensors.int6_weight(*_in_order(src, *_rows(*(
            blocks.six_bit_groups(t, GGUFFile.shape(t)) for t in parts))))
    return tensors.requantized(names.restore(_values(parts, tensors.dequantized), src), fmt)


def _values(parts: list, read) -> torch.Tensor:
    """The parts read by ``read`` (``tensors.float_tensor`` or ``dequantized``), rows
    concatenated (one part: its tensor, the file's pages where ``read`` keeps them)."""
    ts = [read(t, GGUFFile.shape(t)) for t in parts]
    return torch.cat(ts) if len(ts) > 1 else ts[0]


def load_gguf_model(path: str | os.PathLike, dtype="auto", with_mtp: bool = True,
                    device: str | torch.device = "cpu", quantization: str | None = None):
    """Load GGUF file ``path`` -> (model in eval mode, config, path).

    ``dtype``: the float tensors' dtype ("auto": ``auto_dtype``). ``with_mtp``: load the
    nextn (MTP) blocks when the file has them. Quantized tensors keep their precision in
    hybridrt's formats (``tensors``: Q8_0 and IQ4_NL as int8 exactly, IQ4_XS as int8, Q4_0,
    Q4_1, Q4_K as int4 with their values kept, the 5- and 6-bit types as int6) on the CPU,
    and are dequantized to ``dtype`` on other devices. ``quantization`` ("int8", "int4")
    quantizes the float weights of Linears and the embedding as ``load_model`` does."""
    from hybridrt.loader import _FORMATS, _format_of, parse_dtype
    from hybridrt.model import Qwen35ForCausalLM
    from hybridrt.options import check_quantization

    quantization = check_quantization(quantization)
    device = torch.device(device)
    f = GGUFFile(path)
    config = model_config(f)
    dtype = auto_dtype(f, device) if isinstance(dtype, str) and dtype.lower() == "auto" \
        else parse_dtype(dtype)
    mtp = with_mtp and config.mtp_num_hidden_layers > 0
    with torch.device("meta"):
        net = Qwen35ForCausalLM(config, with_mtp=mtp)
    expected = {n: tuple(p.shape) for n, p in net.state_dict().items()}
    srcs = names.sources(config, mtp, fused_experts=any(
        n.endswith(".ffn_gate_up_exps.weight") for n in f.tensors))
    _check(f, expected, srcs, config, mtp)

    packable = quant.quantized_names(net)
    state, quantized = {}, {}
    for name in expected:
        src = srcs[name]
        parts = _parts(f, src)
        fmt = tensors.QUANT_FORMATS.get(tensors.type_name(parts[0]))
        if name in packable and fmt is not None and device.type == "cpu":
            quantized[name] = _packed(parts, src)  # a copy: the file's pages may go
            for t in parts:
                release_pages(torch.from_numpy(t.data.reshape(-1).view(np.uint8)))
            continue
        w = names.restore(_values(parts, tensors.float_tensor if fmt is None
                                  else tensors.dequantized), src)
        if name in packable and quantization:
            quantized[name] = _FORMATS[_format_of(quantization, name)][3](w.to(device))
        else:
            state[name] = w.to(device=device, dtype=dtype)
    quant.attach(net, quantized, dtype)
    net.load_state_dict(state, assign=True, strict=True)
    net.eval().requires_grad_(False)
    net.owns_weights = True
    return net, config, f.path
