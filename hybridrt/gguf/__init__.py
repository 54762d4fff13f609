"""GGUF files (llama.cpp's format, as ollama, unsloth and bartowski publish Qwen3.5, dense
``qwen35`` and MoE ``qwen35moe``) read as hybridrt models: ``LLM("model.gguf")`` and
``hybridrt chat model.gguf`` need no other file; an ``mmproj`` file beside one is its vision
tower (``mmproj``).

``reader`` opens and checks a file (memory-mapped, through llama.cpp's own ``gguf`` package),
``config`` turns its metadata into a ``ModelConfig``, ``names`` undoes what llama.cpp's converter
did to each tensor, ``tensors`` maps each tensor type onto hybridrt's weight formats,
``tokenizer`` rebuilds the tokenizer and chat template from ``tokenizer.ggml.*`` and ``loader``
puts it together (``load_gguf_model``). See docs/gguf.md.
"""

from __future__ import annotations

import os
from pathlib import Path

GGUF_MAGIC = b"GGUF"


def is_gguf_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file: a regular file ending in ``.gguf``, or any regular
    file that starts with the GGUF magic."""
    p = Path(path).expanduser()
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with p.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False
