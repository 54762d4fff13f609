"""A GGUF file's non-weight files as a checkpoint directory holds them, for ``hybridrt
quantize x.gguf OUT`` (``loader.save_quantized``): config.json (the metadata's
``text_config``), tokenizer.json and tokenizer_config.json (the rebuilt tokenizer, its chat
template and special tokens), generation_config.json (eos ids, ``general.sampling.*``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybridrt.gguf.config import sampling_defaults, text_config
from hybridrt.gguf.reader import GGUFFile
from hybridrt.gguf.tokenizer import GGUFTokenizer


def write_checkpoint_files(path: str | os.PathLike, out: str | os.PathLike) -> list[str]:
    """Write the files beside the weights for GGUF file ``path`` into directory ``out`` ->
    their names."""
    f, out = GGUFFile(path), Path(out)
    text = text_config(f)
    arch = "Qwen3_5MoeForCausalLM" if text["model_type"] == "qwen3_5_moe_text" else \
        "Qwen3_5ForCausalLM"
    config = {"architectures": [arch], **text}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok = GGUFTokenizer(f)
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "clean_up_tokenization_spaces": False, **tok.special_tokens_map}
    template = tok.chat_template
    if isinstance(template, dict):
        template = [{"name": k, "template": v} for k, v in template.items()]
    if template is not None:
        tok_config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    sampling = sampling_defaults(path)
    generation = {"eos_token_id": config["eos_token_id"], **sampling}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
