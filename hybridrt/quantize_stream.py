"""``hybridrt quantize`` shard by shard: a checkpoint's weights quantized and written one input
shard at a time, so that memory holds one shard's output (and one tensor being quantized),
never the model: what a 35B-A3B-sized bf16 checkpoint needs on a machine smaller than it.

The output is what ``loader.save_quantized`` writes (the same tensors, names, formats and
metadata; one output shard per input shard, with an index), and loads the same way.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from hybridrt.kernels import quant
from hybridrt.kernels.memory import release_pages
from hybridrt.loader import (
    _FORMATS,
    QUANT_FORMATS_METADATA,
    QUANT_METADATA,
    CheckpointError,
    _format_of,
    _prequantized,
    _read,
    _weight_files,
    canonical_name,
    checkpoint_dtype,
    int8_formats,
    load_config,
)
from hybridrt.model import Qwen35ForCausalLM
from hybridrt.model_path import resolve_model_path
from hybridrt.moe_checkpoint import _SPLIT, adapt_expert_tensors
from hybridrt.options import check_quantization


def quantize_streaming(model: str | os.PathLike, out: str | os.PathLike,
                       quantization: str = "int8", int8_parts: tuple[str, ...] = ()) -> dict:
    """Write ``model`` (a checkpoint directory or hub id) with its weights quantized as
    ``quantization`` ("int8" or "int4") into the new directory ``out``, input shard by input
    shard (an MoE checkpoint's per-expert gate and up halves may lie in different shards: the
    first waits for the second) -> {"path", "bytes", "tensors", "shards"}. Missing,
    mis-shaped and unexpected tensors fail as the loader fails them. ``int8_parts``: as
    ``loader.save_quantized``'s."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    quantization = check_quantization(quantization)
    if quantization is None:
        raise ValueError("quantize: name a quantization (int8 or int4)")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")
    path = resolve_model_path(model)
    config = load_config(path)
    files = _weight_files(path)
    opened = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    if _prequantized(opened, path):
        raise CheckpointError(f"{path} is quantized already (hybridrt quantize)")
    with torch.device("meta"):
        net = Qwen35ForCausalLM(config, with_mtp=True)
    expected = {n: tuple(p.shape) for n, p in net.state_dict().items()}
    to_quantize = quant.quantized_names(net)
    formats = int8_formats(sorted(to_quantize), int8_parts, quantization)
    metadata = {"format": "pt", QUANT_METADATA: quantization}
    if formats:  # what differs from int4's own choice, declared as save_quantized declares it
        metadata[QUANT_FORMATS_METADATA] = json.dumps(
            {n: _format_of(quantization, n, formats=formats) for n in sorted(to_quantize)})
    dtype = None
    live: dict[str, tuple[object, str]] = {}  # read, not yet written (and waiting halves)
    file_of: dict[str, Path] = {}
    written, unexpected, mismatched = set(), [], []
    weight_map, total, count = {}, 0, 0
    out.mkdir(parents=True, exist_ok=True)
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    for i, (h, f, fname) in enumerate(zip(opened, files, names)):
        for raw in h.keys():  # noqa: SIM118 (safe_open handles are not iterable)
            canon = canonical_name(raw)
            if canon is not None:
                live[canon] = (h, raw)
                file_of[raw] = f
        if config.num_experts:
            adapt_expert_tensors(live, file_of)
        if dtype is None:
            dtype = checkpoint_dtype(path, live, torch.device("cpu"))
        tensors = {}
        for canon in [c for c in live if not _SPLIT.match(c)]:
            h_, raw = live.pop(canon)
            if canon not in expected:
                if not (canon == "lm_head.weight" and config.tie_word_embeddings):
                    unexpected.append(raw)
                continue
            shape = tuple(h_.get_slice(raw).get_shape())
            if shape != expected[canon]:
                mismatched.append(f"{raw}: expected {list(expected[canon])}, found "
                                  f"{list(shape)}")
                continue
            t = _read({canon: (h_, raw)}, file_of, canon)
            if canon in to_quantize:
                qw = _FORMATS[_format_of(quantization, canon, formats=formats)][3](t)
                release_pages(t)
                for part, x in zip(qw.names, qw.tensors()):
                    tensors[f"{canon}.{part}"] = x.contiguous()
            else:
                tensors[canon] = t.to(dtype).contiguous()
            written.add(canon)
        if unexpected or mismatched:
            break
        save_file(tensors, str(out / fname), metadata=metadata)
        total += (out / fname).stat().st_size
        count += len(tensors)
        weight_map.update({n: fname for n in tensors})
        del tensors
        # the shard's handle (its file mapping, whose pages count in the process's RSS)
        # lives on only in halves still waiting for their partner
        opened[i] = h = h_ = None
    missing = [n for n in expected if n not in written and not n.startswith("mtp.")]
    if any(n.startswith("mtp.") for n in written):
        missing += [n for n in expected if n.startswith("mtp.") and n not in written]
    unexpected += [raw for _, raw in live.values()]  # halves whose partner never came
    if missing or mismatched or unexpected:
        shutil.rmtree(out)
        lines = [f"checkpoint {path} does not match its config:"]
        lines += [f"  missing tensor: {m}" for m in missing]
        lines += [f"  shape mismatch: {m}" for m in mismatched]
        lines += [f"  unexpected tensor: {u}" for u in unexpected]
        raise CheckpointError("\n".join(lines))
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    umask = os.umask(0)
    os.umask(umask)
    for fname in names:
        os.chmod(out / fname, 0o666 & ~umask)  # safetensors writes it owner-only
    for f in path.iterdir():  # config, tokenizer, generation config, chat template ...
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json",
                                                ".bin", ".pt", ".pth")):
            shutil.copy2(f, out / f.name)
    return {"path": str(out), "bytes": total, "tensors": count, "shards": len(names)}
