"""A random-weight checkpoint of the Qwen3.5-35B-A3B text shape (its real widths and all 256
experts) with fewer decoder layers, for ``hybridrt bench throughput`` / ``steps`` on the MoE
shape::

    python -m hybridrt.bench.moe_shape OUT --layers 8 --quantization int4

With ``--quantization int8|int4`` it is written straight in ``hybridrt quantize``'s format,
one tensor at a time. Either way it is written in shards (the embedding, each decoder layer,
the final norm and head, the MTP layer) with a ``model.safetensors.index.json``: the model is
never held, peak memory is about twice one shard (safetensors' ``save_file`` serialises a
whole file in memory). The layers keep the 3:1 GDN : attention pattern; fewer layers than one
period end with an attention layer (the engine needs one). ``--quantization none`` writes bf16
as the published checkpoints are laid out (``qwen3_5_moe`` config, ``model.language_model.*``,
per-expert ``gate_proj`` / ``up_proj`` / ``down_proj``; some 1.6 GiB a layer): what llama.cpp's
converter and ``hybridrt quantize`` read; quantized from it, it is tensor for tensor the
checkpoint written quantized straight away with the same seed. The config is
``QWEN35_35B_A3B_TEXT_CONFIG`` with ``num_hidden_layers`` replaced; nothing else here knows
the 35B-A3B numbers.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

QWEN35_35B_A3B_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attn_output_gate": True,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                        "mrope_interleaved": True},
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "mtp_num_hidden_layers": 1,
    "hidden_act": "silu",
    "eos_token_id": 248044,
    "tie_word_embeddings": False,
}


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One tensor of ``bench.fixtures.random_state_dict``'s kinds, in bf16."""
    if name.endswith("A_log"):
        t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    elif name.endswith("dt_bias"):
        t = torch.randn(shape, generator=gen) * 0.5
    elif "norm" in name.rsplit(".", 2)[-2]:
        t = 0.1 * torch.randn(shape, generator=gen) + name.endswith("linear_attn.norm.weight")
    else:  # linear [out, in], the conv [C, 1, K], the embedding: in row chunks, so that a
        # vocabulary-sized matrix has no fp32 copy
        t = torch.empty(shape, dtype=torch.bfloat16)
        rows = t.view(-1, shape[-1])
        for r in range(0, rows.shape[0], 8192):
            part = rows[r:r + 8192]
            part.copy_(torch.randn(part.shape, generator=gen) / math.sqrt(shape[-1]))
        return t
    return t.to(torch.bfloat16)


def _shard_of(name: str) -> str:
    """The shard a tensor of our naming is written to."""
    if name.startswith("model.layers."):
        return "layer" + name.split(".")[2]
    if name.startswith("mtp."):
        return "mtp"
    return "embed" if name.startswith("model.embed_tokens.") else "head"


def _published(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names and experts -> the published checkpoints' (``to_per_expert``,
    ``model.language_model.*``)."""
    from hybridrt.moe_checkpoint import to_per_expert

    return {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t
            for n, t in to_per_expert(tensors).items()}


def _drawn_shard(shard: str, shapes: dict, names: set, quantization: str | None,
                 gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One shard's tensors drawn at random (``names``: those quantized, as ``quantization``)."""
    from hybridrt.loader import _FORMATS, _format_of

    tensors = {}
    for name in [n for n in shapes if _shard_of(n) == shard]:
        t = _random(name, shapes[name], gen)
        if name in names:
            qw = _FORMATS[_format_of(quantization, name)][3](t)
            for part, x in zip(qw.names, qw.tensors()):
                tensors[f"{name}.{part}"] = x.contiguous()
        else:
            tensors[name] = t
        del t
    return tensors


def write_shape_checkpoint(out: str | Path, layers: int = 8, quantization: str | None = "int4",
                           seed: int = 0, with_mtp: bool = True,
                           text_config: dict[str, Any] = QWEN35_35B_A3B_TEXT_CONFIG,
                           distinct: int | None = None) -> dict:
    """Write ``text_config``'s shape (default the 35B-A3B's) with ``layers`` decoder layers
    into the new directory ``out``, shard by shard -> {"path", "bytes", "layers",
    "quantization"}. ``distinct``: only the first ``distinct`` layers (a multiple of the
    attention interval) are drawn; layer i past them holds layer ``i % distinct``'s tensors (the
    same bytes in its own shard: what a decode step reads and costs is unchanged, and the full
    40-layer shape is written in minutes instead of drawing and quantizing 32B weights)."""
    from safetensors.torch import save_file

    from hybridrt.bench.fixtures import published_config
    from hybridrt.config import ModelConfig
    from hybridrt.kernels import quant
    from hybridrt.loader import QUANT_METADATA
    from hybridrt.model import Qwen35ForCausalLM

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")
    text = {k: v for k, v in text_config.items() if k != "layer_types"}
    text["num_hidden_layers"] = layers
    interval = text.get("full_attention_interval", 4)
    text["layer_types"] = ["full_attention" if (i + 1) % interval == 0 or (
        i == layers - 1 and layers < interval) else "linear_attention" for i in range(layers)]
    if distinct is not None and (distinct < 1 or distinct % interval or distinct > layers):
        raise ValueError(f"distinct layers must be a multiple of {interval} up to {layers}, "
                         f"got {distinct}")
    config = ModelConfig.from_dict(text)
    with torch.device("meta"):
        net = Qwen35ForCausalLM(config, with_mtp=with_mtp)
    names = quant.quantized_names(net) if quantization else set()
    shapes = {name: tuple(p.shape) for name, p in net.state_dict().items()}
    shards = list(dict.fromkeys(_shard_of(n) for n in shapes))
    metadata = {"format": "pt"}
    if quantization:
        metadata[QUANT_METADATA] = quantization
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    drawn: dict[int, dict[str, torch.Tensor]] = {}  # the distinct layers' shards, by layer
    for i, shard in enumerate(shards):
        layer = int(shard[5:]) if shard.startswith("layer") else None
        if distinct is not None and layer is not None and layer >= distinct:
            src = f"model.layers.{layer % distinct}."
            tensors = {f"model.layers.{layer}." + n[len(src):]: x
                       for n, x in drawn[layer % distinct].items()}
        else:
            tensors = _drawn_shard(shard, shapes, names, quantization, gen)
            if distinct is not None and layer is not None:
                drawn[layer] = tensors
        if not quantization:
            tensors = _published(tensors)
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / fname), metadata=metadata)
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    config_json = published_config(text) if not quantization else {
        "architectures": ["Qwen3_5MoeForCausalLM"], **text}
    (out / "config.json").write_text(json.dumps(config_json, indent=2))
    return {"path": str(out), "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
            "layers": layers, "quantization": quantization}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hybridrt.bench.moe_shape",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="new (or empty) directory")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (default 8 of 40)")
    ap.add_argument("--quantization", default="int4", choices=["int8", "int4", "none"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--distinct-layers", type=int, default=None, metavar="N",
                    help="draw only the first N layers (a multiple of the attention interval); "
                         "the later ones repeat them (default: every layer drawn)")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error("--layers must be >= 1")
    try:
        info = write_shape_checkpoint(args.out, args.layers,
                                      None if args.quantization == "none" else args.quantization,
                                      args.seed, distinct=args.distinct_layers)
    except ValueError as e:
        ap.error(str(e))
    print(f"wrote {info['path']}: {info['layers']} layers, {info['quantization'] or 'bf16'}, "
          f"{info['bytes'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
