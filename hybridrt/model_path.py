"""MODEL (a checkpoint directory, a GGUF file or a Hugging Face id) -> a local checkpoint
directory or GGUF file.

Torch-free, so that the command line can check MODEL before the slow imports and the loader
resolves it by the same rules."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "tokenizer*"]


class ModelNotFoundError(FileNotFoundError):
    """The model path or hub id cannot be resolved to a checkpoint directory."""


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A local checkpoint directory (it must hold a config.json) or GGUF file (``*.gguf``, or a
    file that starts with the GGUF magic: ollama's blobs), or a Hugging Face id found in
    the local cache or fetched from the Hub. Raises ModelNotFoundError, one line naming MODEL
    and why, when neither works."""
    text = str(model)
    if not text.strip():
        raise ModelNotFoundError("the model path is empty: give a checkpoint directory or a "
                                 "Hugging Face id (or no model for the embedded demo)")
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json: not a model directory")
        return path
    if path.exists():
        from hybridrt.gguf import is_gguf_path

        if is_gguf_path(path):
            return path
        raise ModelNotFoundError(f"{path} is a file, expected a model directory or a GGUF "
                                 f"file")
    if not _HUB_ID.match(text) or text.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model {text!r} not found: no such directory, and it is not "
                                 f"a Hugging Face id")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(text, allow_patterns=_HUB_PATTERNS, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or a broken cache entry): try the Hub
        pass
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"model {text!r} is not a local directory nor in the Hugging "
                                 f"Face cache, and HF_HUB_OFFLINE is set (no Hub look-ups)")
    try:
        return Path(snapshot_download(text, allow_patterns=_HUB_PATTERNS))
    except (RepositoryNotFoundError, GatedRepoError):
        why = "the Hugging Face Hub has no such model (or it is private or gated)"
    except Exception as e:  # noqa: BLE001 - offline, DNS, a proxy ...
        why = f"the Hugging Face Hub cannot be reached ({_root_cause(e)})"
    raise ModelNotFoundError(f"model {text!r} is not a local directory nor in the Hugging Face "
                             f"cache, and {why}")


def _root_cause(e: BaseException) -> str:
    """The innermost exception's first line: 'Name or service not known', not the chain."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else type(e).__name__
    return re.sub(r"^\[Errno -?\d+\] ", "", text)[:160]


DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"


def default_model() -> str:
    """The embedded demo checkpoint, the default model of every entry point."""
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"no model given and the embedded demo checkpoint is missing at {DEMO_MODEL_DIR}"
        )
    return str(DEMO_MODEL_DIR)


# generation_config.json fields that become SamplingParams defaults (vLLM reads the same)
_GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                      "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                      "max_new_tokens": "max_tokens"}


def generation_defaults(model_path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's recommended sampling settings (``generation_config.json``; a GGUF
    file's ``general.sampling.*``) as SamplingParams fields; {} without them."""
    if Path(model_path).is_file():
        from hybridrt.gguf.config import sampling_defaults

        return sampling_defaults(model_path)
    path = Path(model_path) / "generation_config.json"
    try:
        raw = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {ours: raw[theirs] for theirs, ours in _GENERATION_FIELDS.items()
            if isinstance(raw.get(theirs), (int, float)) and not isinstance(raw[theirs], bool)}
