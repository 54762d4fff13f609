"""``load_gguf_model``: a GGUF file -> (our model, its config, the file's path), as
``hybridrt.loader.load_model`` loads a checkpoint directory.

Everything is checked before any weight is read: the header, the architecture, the config,
every tensor's presence, shape and type (``GGUFError``, one line). Float tensors keep the
file's pages where no transform or dtype change applies; quantized ones map onto hybridrt's
formats per tensor (``tensors``), so a mixed file keeps each tensor's precision.
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
    problems = []
    for name, shape in expected.items():
        src = srcs[name]
        t = f.tensors.get(src.name)
        if t is None:
            problems.append(f"tensor {src.name} is missing")
            continue
        want = names.stored_shape(shape, src)
        found = GGUFFile.shape(t)
        if found != want:
            problems.append(f"tensor {src.name} has shape {list(found)}, expected {list(want)}")
        elif not tensors.supported(t):
            problems.append(f"tensor {src.name} has type {tensors.type_name(t)}, which hybridrt "
                            f"does not load (it loads {', '.join(tensors.FLOAT_TYPES)}, "
                            f"{', '.join(tensors.QUANT_FORMATS)})")
    used = {s.name for s in srcs.values()}
    for name in f.tensors:
        if name in used or (not with_mtp and names.is_mtp_tensor(name, config)):
            continue
        problems.append(f"tensor {name} is not one of a qwen35 model's")
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


def _packed(t, shape, src: names.Source) -> quant.PackedWeight:
    """A quantized GGUF weight in hybridrt's format for its type (``tensors``; in one pass of
    compiled code where ``repack`` takes it)."""
    fast = repack.packed(t, shape, src)
    if fast is not None:
        return fast
    kind = tensors.type_name(t)
    fmt = tensors.QUANT_FORMATS[kind]
    if fmt == "int8":
        q, d = _in_order(src, *blocks.int8_groups(t, shape))
        if (q == -128).any():
            raise GGUFError(f"{src.name}: {kind} value -128 (llama.cpp never writes it; "
                            f"hybridrt's int8 kernels take -127..127)")
        return tensors.int8_weight(q, d)
    if kind in tensors.NIBBLE_TYPES:
        q, step, minimum = _in_order(src, *blocks.nibble_groups(t, shape))
        if (minimum >= 0).all():
            return tensors.int4_weight(q, step, minimum)
    if kind == "Q6_K":
        return tensors.int6_weight(*_in_order(src, *blocks.six_bit_groups(t, shape)))
    return tensors.requantized(names.restore(tensors.dequantized(t, shape), src), fmt)


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
    srcs = names.sources(config, mtp)
    _check(f, expected, srcs, config, mtp)

    packable = quant.quantized_names(net)
    state, quantized = {}, {}
    for name, shape in expected.items():
        src = srcs[name]
        t = f.tensors[src.name]
        kind = tensors.type_name(t)
        fmt = tensors.QUANT_FORMATS.get(kind)
        if name in packable and fmt is not None and device.type == "cpu":
            quantized[name] = _packed(t, shape, src)  # a copy: the file's pages may go
            release_pages(torch.from_numpy(t.data.reshape(-1).view(np.uint8)))
            continue
        if fmt is None:
            w = names.restore(tensors.float_tensor(t, names.stored_shape(shape, src)), src)
        else:
            w = names.restore(tensors.dequantized(t, names.stored_shape(shape, src)), src)
        if name in packable and quantization:
            quantized[name] = _FORMATS[_format_of(quantization, name)][3](w.to(device))
        else:
            state[name] = w.to(device=device, dtype=dtype)
    quant.attach(net, quantized, dtype)
    net.load_state_dict(state, assign=True, strict=True)
    net.eval().requires_grad_(False)
    net.owns_weights = True
    return net, config, f.path
