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


def has_vision_tower(model_path: str | os.PathLike,
                     mmproj: str | os.PathLike | None = None) -> bool:
    """Does the checkpoint hold a vision tower: a ``vision_config`` and ``model.visual.*``
    weights (the names read from the safetensors headers only)? A GGUF file: is a projector
    given (``mmproj``) or found beside it?"""
    path = Path(model_path)
    if path.is_file():
        from hybridrt.gguf.mmproj import find_mmproj

        return mmproj is not None or find_mmproj(path) is not None
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


def refusal_reason(has_tower: bool, language_model_only: bool = False) -> str:
    """Why a model without a loaded tower refuses images and video."""
    if has_tower and language_model_only:
        return "the vision tower was not loaded (language_model_only)"
    return "this model has no vision tower"


MM_LIMIT_KINDS = ("image", "video")  # the keys of vLLM's limit_mm_per_prompt taken here


def parse_mm_limits(value: Any) -> dict[str, int] | None:
    """``limit_mm_per_prompt`` (vLLM's: {"image": N}, or its JSON text as the CLI gives it)
    -> the dict; a one-line ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"limit_mm_per_prompt is not valid JSON: {e}") from None
    if not isinstance(value, dict) or any(
            k not in MM_LIMIT_KINDS or not isinstance(n, int) or isinstance(n, bool) or n < 0
            for k, n in value.items()):
        raise ValueError(f"limit_mm_per_prompt must map 'image' (or 'video') to the most items "
                         f"one prompt may hold, e.g. {{\"image\": 4}}, got {value!r}")
    return dict(value)


def check_media_count(kind: str, count: int, limit: int | None) -> None:
    """ValueError where a prompt holds more ``kind`` items ("image", "video") than ``limit``
    (None: no limit)."""
    if limit is not None and count > limit:
        raise ValueError(f"the prompt holds {count} {kind}(s), over the limit of {limit} "
                         f"per prompt (limit_mm_per_prompt / --limit-mm-per-prompt)")


def multi_modal_media(data: Any) -> tuple[list, list]:
    """``multi_modal_data`` (vLLM's shape: {"image": an image or a list of them, "video": a
    video or a list of them}) -> (images, videos); ValueError for what is not taken. A video
    is a list of frames, a (T, H, W, 3) array, vLLM's (frames, metadata) or a file
    (hybridrt.vision.video)."""
    from hybridrt.vision.video import is_video

    if not isinstance(data, dict):
        raise ValueError(f"multi_modal_data must be a dict like {{'image': [...]}}, got "
                         f"{type(data).__name__}")
    other = sorted(str(k) for k in data if k not in MM_LIMIT_KINDS)
    if other:
        raise ValueError(f"multi_modal_data {other} refused: only 'image' and 'video' are "
                         f"supported")
    images = data.get("image", [])
    videos = data.get("video", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    single = is_video(videos) or not isinstance(videos, (list, tuple))
    videos = [videos] if single else list(videos)
    return images, videos


def chat_media(messages: list[dict]) -> tuple[list[dict], list, list]:
    """A conversation's image and video parts -> (the messages with each part as ``{"type":
    "image"}`` or ``{"type": "video"}``, what a chat template renders as its placeholder; the
    images, in order: PIL images, data URLs or paths; the videos, in order: frames, data URLs
    or paths)."""
    out, images, videos = [], [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in VIDEO_PART_TYPES:
                videos.append(_part_media(p, kind, f"messages[{i}].content[{j}]"))
                parts.append({"type": "video"})
            elif kind in IMAGE_PART_TYPES:
                images.append(_part_media(p, kind, f"messages[{i}].content[{j}]"))
                parts.append({"type": "image"})
            else:
                parts.append(p)
        out.append({**m, "content": parts})
    return out, images, videos


def _part_media(part: dict, kind: str, where: str):
    value = part.get(kind)
    if kind in ("image_url", "input_image", "video_url", "input_video") and \
            isinstance(value, dict):
        value = value.get("url")
    if kind in ("input_image", "input_video") and value is None:
        value = part.get(kind.replace("input_", "") + "_url")
    if value is None:
        raise ValueError(f"{where}: an {kind!r} part without its "
                         f"{'video' if kind in VIDEO_PART_TYPES else 'image'}")
    return value


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
