"""Image and video inputs at the interfaces: the prompt fields and chat content parts that
carry them, and the one-line refusal a model that cannot take them gives (never a silent
drop: a request whose image would be ignored is refused)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# OpenAI's, vLLM's and transformers' names of a chat content part holding an image or a video
IMAGE_PART_TYPES = ("image_url", "image", "input_image", "image_pil")
VIDEO_PART_TYPES = ("video_url", "video", "input_video")
MEDIA_PART_TYPES = IMAGE_PART_TYPES + VIDEO_PART_TYPES


def has_vision_tower(model_path: str | os.PathLike) -> bool:
    """Does the checkpoint hold a vision tower: a ``vision_config`` and ``model.visual.*``
    weights (the names read from the safetensors headers only)?"""
    path = Path(model_path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict) or not isinstance(config.get("vision_config"), dict):
        return False
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            names = json.loads(index.read_text()).get("weight_map", {})
        else:
            from safetensors import safe_open

            names = []
            for f in sorted(path.glob("*.safetensors")):
                with safe_open(str(f), "pt") as h:
                    names += list(h.keys())
    except (OSError, ValueError, AttributeError):
        return False
    return any(n.startswith(("model.visual.", "visual.")) for n in names)


def refusal_reason(has_tower: bool) -> str:
    """Why a model refuses images and video."""
    if has_tower:
        return "images and video are not supported yet (hybridrt does not run this " \
               "checkpoint's vision tower)"
    return "this model has no vision tower"


def media_parts(messages: Any) -> list[tuple[int, int, str]]:
    """(message index, part index, part type) of every image or video content part."""
    found = []
    if not isinstance(messages, list):
        return found
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") in MEDIA_PART_TYPES:
                found.append((i, j, p["type"]))
    return found


def media_refusal(messages: Any, reason: str) -> str | None:
    """The refusal of a conversation holding an image or video part (naming the first), or
    None where it holds none."""
    parts = media_parts(messages)
    if not parts:
        return None
    i, j, kind = parts[0]
    more = f" (and {len(parts) - 1} more)" if len(parts) > 1 else ""
    return f"messages[{i}].content[{j}] is an {kind!r} part{more}: refused, {reason}"


def multi_modal_refusal(prompt: dict, reason: str) -> str | None:
    """The refusal of a prompt dict carrying ``multi_modal_data`` (vLLM's field), or None."""
    data = prompt.get("multi_modal_data")
    if data is None or data == {}:
        return None
    kinds = ", ".join(sorted(map(str, data))) if isinstance(data, dict) else type(data).__name__
    return f"multi_modal_data ({kinds}) refused: {reason}"


@dataclass(frozen=True, slots=True)
class RefusedPrompt:
    """A prompt refused while it was built (a chat with an image part): its request fails
    with ``error`` alone, beside the others."""

    error: ValueError
