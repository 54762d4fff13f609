"""Find, validate and load Qwen3.5 checkpoints (safetensors, single file or sharded)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hybridrt.config import ConfigError, ModelConfig
from hybridrt.kernels import int4, quant
from hybridrt.kernels.memory import release_pages
from hybridrt.model import Qwen35ForCausalLM
from hybridrt.model_path import ModelNotFoundError, resolve_model_path  # noqa: F401
from hybridrt.moe_checkpoint import adapt_expert_tensors
from hybridrt.options import DTYPE_NAMES, check_quantization

DTYPES = {name: getattr(torch, attr) for name, attr in DTYPE_NAMES.items()}
class CheckpointError(ValueError):
    """A checkpoint whose tensors do not fit the config (every offending name is listed)."""


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use bfloat16, float16 or float32")
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}; choose one of bfloat16, float16, float32"
        ) from None


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def checkpoint_dtype(path: Path, handles: dict, device: torch.device) -> torch.dtype:
    """``dtype="auto"``: the dtype the checkpoint declares (``dtype`` / ``torch_dtype`` in
    config.json, text_config first), else that of its weights. On CUDA a float32 checkpoint
    loads as bfloat16, the dtype the GPU kernels are written for."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        raw = {}
    found = None
    for cfg in (raw.get("text_config"), raw):
        if isinstance(cfg, dict):
            for key in ("dtype", "torch_dtype"):
                if isinstance(cfg.get(key), str) and cfg[key].lower() in DTYPES:
                    found = found or DTYPES[cfg[key].lower()]
    if found is None:
        for canon, (h, name) in handles.items():
            if canon.endswith(_QUANT_PARTS):
                continue  # quantized values and their scales (save_quantized)
            found = _SAFETENSORS_DTYPES.get(h.get_slice(name).get_dtype())
            if found is not None:
                break
    found = found or torch.bfloat16
    if device.type == "cuda" and found == torch.float32:
        return torch.bfloat16
    return found


def _refuse_gguf_overrides(path, overrides: dict | None) -> None:
    if overrides:
        raise ConfigError(f"hf_overrides apply to a config.json; {path} is a GGUF file, whose "
                          f"settings come from its metadata")


def load_config(path: Path, overrides: dict | None = None) -> ModelConfig:
    """``path``'s config.json (``overrides`` merged into it, as ``hf_overrides``) with the
    eos ids of its generation_config.json; a GGUF file's metadata."""
    if Path(path).is_file():  # a GGUF file: its metadata
        _refuse_gguf_overrides(path, overrides)
        from hybridrt.gguf.config import model_config
        from hybridrt.gguf.reader import GGUFFile

        return model_config(GGUFFile(path))
    config = ModelConfig.from_file(path / "config.json", overrides)
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise ConfigError(f"{gen} is not valid JSON: {e}") from None
        for e in [eos] if isinstance(eos, int) else (eos or []):
            if int(e) not in config.eos_token_ids:
                config.eos_token_ids.append(int(e))
    return config


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is malformed: {e}") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return [path / f for f in files]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {path}")
    return files


def _read(handles: dict, file_of: dict, name: str) -> torch.Tensor:
    h, raw = handles[name]
    try:
        return h.get_tensor(raw)
    except Exception as e:
        raise CheckpointError(f"cannot read tensor {raw} from {file_of[raw]} (truncated "
                              f"file?): {e}") from None


QUANT_METADATA = "hybridrt.quantization"  # safetensors metadata key of save_quantized's files
# with weights of several formats (from a GGUF file): JSON {parameter name: format}
QUANT_FORMATS_METADATA = "hybridrt.formats"
# the stored tensors of each quantized weight: int8 .qs and .scales, 4-bit .qs, .codes, .scales,
# 6-bit .qs, .hs, .codes, .scales
_QUANT_PARTS = (".qs", ".hs", ".codes", ".scales")
# per format: the weight class, its tensors' shapes and dtypes, the quantizer
_FORMATS = {
    "int8": (quant.QuantWeight, quant.packed_shapes, (torch.int8, torch.float16), quant.quantize),
    "int4": (int4.Int4Weight, int4.packed_shapes, (torch.uint8, torch.uint8, torch.bfloat16),
             int4.quantize),
    "int6": (int4.Int6Weight, lambda shape: int4.packed_shapes(shape, 6),
             (torch.uint8, torch.uint8, torch.uint8, torch.bfloat16),
             lambda w: int4.quantize(w, 6)),
}


def _format_of(quantization: str, name: str, stored: dict | None = None,
               formats: dict | None = None) -> str:
    """The format parameter ``name`` takes under ``quantization``: int4 takes 6 bits for the
    embedding / LM head. ``stored``: a stored checkpoint's tensors, by name: an int4 one written
    before the 6-bit head (its .qs without .hs or .codes) holds it in int8. ``formats``: the
    formats a checkpoint of mixed ones declares (``QUANT_FORMATS_METADATA``), by name."""
    if formats and name in formats:
        return formats[name]
    if quantization == "int8":
        return "int8"
    if not int4.six_bit(name):
        return "int4"
    if stored is not None and f"{name}.qs" in stored and not {f"{name}.hs", f"{name}.codes"} & \
            stored.keys():
        return "int8"
    return "int6"


class Int8PartsError(ValueError):
    """``int8_parts`` that cannot apply (``int8_formats``, ``load_model``)."""


def int8_formats(names, int8_parts, quantization: str | None) -> dict | None:
    """``{weight: "int8"}`` for the weights to quantize (``names``) whose name holds one of
    ``int8_parts`` (substrings such as ``self_attn``, ``linear_attn``, ``shared_expert``:
    ``hybridrt quantize --int8``), kept at 8 bits under int4; None without parts.
    Int8PartsError for parts under another quantization, or a part that names no such
    weight."""
    if not int8_parts:
        return None
    if quantization != "int4":
        raise Int8PartsError(f"int8 parts ({', '.join(int8_parts)}) apply under int4 "
                         f"quantization, not {quantization}")
    formats = {}
    for part in int8_parts:
        hits = {n: "int8" for n in names if part in n}
        if not hits:
            raise Int8PartsError(f"int8 part {part!r} names no quantized weight of this model "
                             f"(e.g. self_attn, linear_attn, mlp, shared_expert, experts, mtp)")
        formats.update(hits)
    return formats


def _declared_formats(opened: list, path: Path) -> dict | None:
    """The per-weight formats a checkpoint written from a mixed GGUF file declares, or None."""
    raw = next((v for h in opened if (v := (h.metadata() or {}).get(QUANT_FORMATS_METADATA))),
               None)
    if raw is None:
        return None
    try:
        formats = json.loads(raw)
    except json.JSONDecodeError:
        formats = None
    if not isinstance(formats, dict) or set(formats.values()) - _FORMATS.keys():
        raise CheckpointError(f"{path}: {QUANT_FORMATS_METADATA} must be a JSON object of "
                              f"formats ({', '.join(_FORMATS)}) by weight name")
    return formats


def _prequantized(opened: list, path: Path) -> str | None:
    """The quantization the weight files declare (``save_quantized``), or None; all or none of
    them must."""
    kinds = {(h.metadata() or {}).get(QUANT_METADATA) for h in opened}
    if len(kinds) > 1:
        raise CheckpointError(f"{path}: some weight files are quantized (hybridrt quantize) "
                              f"and some are not, or not alike")
    kind = kinds.pop() if kinds else None
    if kind is not None and kind not in _FORMATS:
        raise CheckpointError(f"{path}: unknown {QUANT_METADATA} {kind!r} (this hybridrt "
                              f"reads {' and '.join(_FORMATS)})")
    return kind


def save_quantized(model: str | os.PathLike, out: str | os.PathLike,
                   quantization: str = "int8", int8_parts: tuple[str, ...] = ()) -> dict:
    """Write ``model`` (a checkpoint directory or hub id) with its weights quantized as
    ``quantization`` ("int8" or "int4") quantizes them at load, into the new directory ``out``:
    one model.safetensors (quantized weights in the kernels' layout, ``<name>.qs``,
    ``<name>.scales``, for 4 bits ``<name>.codes`` and for 6 bits also ``<name>.hs``; the other
    tensors in the checkpoint's dtype) and the source's other files (config, tokenizer).
    ``load_model`` reads it without quantizing again; the model computes the same.
    ``int8_parts``: weights kept at 8 bits under int4 (``int8_formats``). -> {"path", "bytes",
    "tensors"}."""
    import shutil

    from safetensors.torch import save_file

    quantization = check_quantization(quantization)
    if quantization is None:
        raise ValueError("save_quantized: name a quantization (int8 or int4)")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")
    net, _, path = load_model(model, dtype="auto", with_mtp=True, quantization=quantization,
                              int8_parts=int8_parts)
    quantization = quant.quantization_of(net) or quantization  # a GGUF's own may be lower
    tensors, formats = {}, {}
    for name, module in net.named_modules():
        qw = getattr(module, "qweight", None)
        if isinstance(qw, quant.PackedWeight):
            formats[f"{name}.weight"] = qw.kind
            for part, t in zip(qw.names, qw.tensors()):
                tensors[f"{name}.weight.{part}"] = t.contiguous()
    metadata = {"format": "pt", QUANT_METADATA: quantization}
    if any(_format_of(quantization, n) != f for n, f in formats.items()):
        metadata[QUANT_FORMATS_METADATA] = json.dumps(formats)
    for name, t in net.state_dict().items():
        tensors[name] = t.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out / "model.safetensors", 0o666 & ~umask)  # safetensors writes it owner-only
    if path.is_file():  # a GGUF file: its metadata written out as the checkpoint's files
        from hybridrt.gguf.export import write_checkpoint_files

        write_checkpoint_files(path, out)
    for f in path.iterdir() if path.is_dir() else ():  # config, tokenizer, chat template ...
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json",
                                                ".bin", ".pt", ".pth")):
            shutil.copy2(f, out / f.name)
    return {"path": str(out), "bytes": (out / "model.safetensors").stat().st_size,
            "tensors": len(tensors)}


def canonical_name(name: str) -> str | None:
    """Checkpoint tensor name -> our parameter name, or None for tensors we ignore (vision)."""
    if name.startswith(("model.visual.", "visual.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model."):
        return "model." + name[len("language_model."):]
    return name


def _stored_name(name: str, handles: dict[str, tuple[object, str]]) -> str:
    """Our parameter name as this checkpoint's layout would store it (for a missing tensor:
    ``model.layers.3...`` is ``model.language_model.layers.3...`` in the published one)."""
    if not name.startswith("model."):
        return name
    for canon, (_, raw) in handles.items():
        if canon.startswith("model.") and raw != canon and raw.endswith(canon[len("model."):]):
            return raw[:len(raw) - len(canon) + len("model.")] + name[len("model."):]
    return name


def load_model(
    model: str | os.PathLike,
    dtype: str | torch.dtype = torch.bfloat16,
    with_mtp: bool = True,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    overrides: dict | None = None,
    int8_parts: tuple[str, ...] = (),
) -> tuple[Qwen35ForCausalLM, ModelConfig, Path]:
    """Load a checkpoint directory, GGUF file (``hybridrt.gguf``) or hub id -> (model in eval
    mode, config, resolved path).

    Tensors are read through memory-mapped ``safe_open`` handles and converted to ``dtype``
    (``"auto"``: the checkpoint's own, see ``checkpoint_dtype``).
    ``mtp.*`` tensors are loaded when ``with_mtp`` and present; ``model.visual.*`` is ignored.
    Missing, unexpected and mis-shaped text tensors fail together in one CheckpointError.
    ``quantization="int8"``: every linear weight and the embedding are quantized as they are
    read (``kernels.quant``), without keeping the full-precision copy; ``"int4"``: the same in
    4 bits (``kernels.int4``; the embedding / LM head in 6 bits). A checkpoint written by
    ``save_quantized`` (``hybridrt quantize``) holds them quantized already: it loads in its
    own quantization whatever ``quantization`` says, with no quantization at start-up.
    ``int8_parts``: under int4, the weights whose names hold one of these stay at 8 bits
    (``int8_formats``).
    """
    from safetensors import safe_open

    from hybridrt.gguf import is_gguf_path

    if is_gguf_path(model):  # a llama.cpp file: hybridrt.gguf undoes its conversion
        from hybridrt.gguf.loader import load_gguf_model

        _refuse_gguf_overrides(model, overrides)
        if int8_parts:
            raise Int8PartsError("int8 parts do not apply to a GGUF file: it keeps each "
                                 "weight's own type")
        return load_gguf_model(resolve_model_path(model), dtype, with_mtp, device, quantization)
    quantization = check_quantization(quantization)
    auto = isinstance(dtype, str) and dtype.lower() == "auto"
    if not auto:
        dtype = parse_dtype(dtype)
    path = resolve_model_path(model)
    config = load_config(path, overrides)

    handles: dict[str, tuple[object, str]] = {}
    file_of: dict[str, Path] = {}  # stored name -> its file, for error messages
    opened = []
    for f in _weight_files(path):
        try:
            h = safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:
            raise CheckpointError(f"cannot read {f} (truncated or corrupt?): {e}") from None
        opened.append(h)
        for name in h.keys():  # noqa: SIM118 (safe_open handles are not iterable)
            canon = canonical_name(name)
            if canon is not None:
                handles[canon] = (h, name)
                file_of[name] = f
    if config.num_experts:  # per-expert or fused experts, read as ours
        adapt_expert_tensors(handles, file_of)

    prequantized = _prequantized(opened, path)
    formats = _declared_formats(opened, path) if prequantized else None
    if prequantized:
        if torch.device(device).type != "cpu":
            raise CheckpointError(f"{path} holds {prequantized} weights (written by hybridrt "
                                  f"quantize), "
                                  f"which run on the CPU only, not on {device}")
        if int8_parts:
            raise Int8PartsError(f"int8 parts do not apply to {path}: it is quantized "
                                 f"already")
        quantization = prequantized
    if auto:
        dtype = checkpoint_dtype(path, handles, torch.device(device))
    has_mtp = any(n.startswith("mtp.") for n in handles)
    with torch.device("meta"):
        net = Qwen35ForCausalLM(config, with_mtp=with_mtp and has_mtp)
    expected = {n: tuple(p.shape) for n, p in net.state_dict().items()}
    to_quantize = quant.quantized_names(net) if quantization else set()
    if not prequantized:
        formats = int8_formats(sorted(to_quantize), int8_parts, quantization)
    if prequantized:  # each quantized weight is stored as its tensors, in the kernels' layout
        for name in to_quantize & set(expected):
            cls, shapes, _, _ = _FORMATS[_format_of(quantization, name, handles, formats)]
            for part, shape in zip(cls.names, shapes(expected.pop(name))):
                expected[f"{name}.{part}"] = shape

    missing, mismatched, unexpected = [], [], []
    for name, shape in expected.items():
        if name not in handles:
            missing.append(f"{_stored_name(name, handles)} (expected {list(shape)})")
            continue
        h, raw = handles[name]
        found = tuple(h.get_slice(raw).get_shape())
        if found != shape:
            mismatched.append(f"{raw}: expected {list(shape)}, found {list(found)}")
    for name in handles:
        if name in expected:
            continue
        if name.startswith("mtp.") and net.mtp is None:
            continue  # speculation not requested: the MTP head stays on disk
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied checkpoint may still store a copy of the embedding
        unexpected.append(handles[name][1])  # the name as stored in the checkpoint
    if missing or mismatched or unexpected:
        lines = [f"checkpoint {path} does not match its config:"]
        lines += [f"  missing tensor: {m}" for m in missing]
        lines += [f"  shape mismatch: {m}" for m in mismatched]
        lines += [f"  unexpected tensor: {u}" for u in unexpected]
        raise CheckpointError("\n".join(lines))

    state, quantized = {}, {}
    if prequantized:
        for name in to_quantize & {n.removesuffix(".qs") for n in expected}:
            fmt = _format_of(quantization, name, handles, formats)
            cls, _, dtypes, _ = _FORMATS[fmt]
            parts = [_read(handles, file_of, f"{name}.{part}") for part in cls.names]
            if [t.dtype for t in parts] != list(dtypes):
                raise CheckpointError(
                    f"{handles[name + '.qs'][1]}: the {fmt} weight's tensors "
                    f"({', '.join(cls.names)}) must be {', '.join(map(str, dtypes))}, found "
                    f"{', '.join(str(t.dtype) for t in parts)}")
            shape = tuple(net.get_parameter(name).shape)
            quantized[name] = cls(*(t.to(device) for t in parts), shape)
    for name in expected:
        if prequantized and name.endswith(_QUANT_PARTS):
            continue
        t = _read(handles, file_of, name)
        if name in to_quantize:
            quantized[name] = _FORMATS[_format_of(quantization, name, formats=formats)][3](
                t.to(device))
            release_pages(t)  # read once: its file pages need not stay resident
        else:
            state[name] = t.to(device=device, dtype=dtype)
    quant.attach(net, quantized, dtype)
    net.load_state_dict(state, assign=True, strict=True)
    net.eval().requires_grad_(False)
    net.owns_weights = True  # nothing else holds these tensors (backends may free replaced ones)
    return net, config, path
