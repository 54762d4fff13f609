"""Images -> the vision tower's patches: decoding (Pillow) and transformers' Qwen2-VL image
processor (resize to multiples of patch_size * spatial_merge_size within min/max pixels,
rescale, normalize, the patches in merge-block order), as the checkpoint's
``preprocessor_config.json`` sets it."""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridrt.vision.config import VisionConfig


def load_image(obj: Any):
    """A PIL image from a PIL image, a numpy array (H, W, 3 uint8), bytes, a ``data:`` URL
    or a local file path; ValueError naming what is wrong otherwise."""
    from PIL import Image

    if isinstance(obj, Image.Image):
        image = obj
    elif isinstance(obj, np.ndarray):
        image = Image.fromarray(obj)
    elif isinstance(obj, (bytes, bytearray)):
        image = _decode(bytes(obj), "the image bytes")
    elif isinstance(obj, (str, os.PathLike)):
        s = str(obj)
        if s.startswith("data:"):
            image = _decode(data_url_bytes(s, "an image"), "the image data URL")
        elif "://" in s:
            raise ValueError(f"image {s[:60]!r}: only data URLs and local paths are accepted")
        else:
            path = Path(s).expanduser()
            if not path.is_file():
                raise ValueError(f"image file {s!r} does not exist")
            image = _decode(path.read_bytes(), f"image file {s!r}")
    else:
        raise ValueError(f"an image must be a PIL image, numpy array, bytes, data URL or path, "
                         f"got {type(obj).__name__}")
    if image.width < 1 or image.height < 1:
        raise ValueError(f"the image has no pixels ({image.width}x{image.height})")
    return image


def _decode(raw: bytes, what: str):
    """Pillow's decompression-bomb warning (over ``Image.MAX_IMAGE_PIXELS``) is a refusal
    here, as its error (over twice that) is."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ValueError(f"{what}: refused, too many pixels ({e})") from None
    except Exception as e:
        raise ValueError(f"{what} cannot be decoded as an image: {e}") from None
    return image


class ImageProcessor:
    """One image -> (patches [n, channels * temporal_patch * patch^2] float32, grid (t, h, w)
    in patches). ``settings`` (the processor's keyword arguments, as a GGUF projector's
    metadata gives them) where given, else the checkpoint's ``preprocessor_config.json`` where
    it has one, else the processor's defaults with the tower's patch, temporal patch and merge
    sizes. transformers' processor is built at the first image: importing transformers costs
    more than the rest of a start-up, and a text-only chat never needs it (the sizes are
    checked against the tower's at once, from the settings)."""

    DEFAULTS = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}  # the processor's

    def __init__(self, model_path: str | os.PathLike, cfg: VisionConfig,
                 settings: dict[str, Any] | None = None):
        path = Path(model_path)
        self._pretrained = None
        if settings is not None:
            self._kwargs = dict(settings)
        elif (path / "preprocessor_config.json").is_file():
            self._pretrained = str(path)
            try:
                self._kwargs = json.loads((path / "preprocessor_config.json").read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"{path / 'preprocessor_config.json'}: cannot be read ({e})") \
                    from None
        else:
            self._kwargs = {"patch_size": cfg.patch_size,
                            "temporal_patch_size": cfg.temporal_patch_size,
                            "merge_size": cfg.spatial_merge_size}
        sizes = tuple(self._kwargs.get(k, d) for k, d in self.DEFAULTS.items())
        if sizes != (cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size):
            raise ValueError(f"{path / 'preprocessor_config.json'}: patch, temporal patch and "
                             f"merge sizes {sizes} differ from the vision_config's")
        self._processor = None

    @property
    def processor(self):
        """transformers' Qwen2-VL image processor (Pillow), built on first use."""
        if self._processor is None:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
                Qwen2VLImageProcessorPil,
            )

            self._processor = (Qwen2VLImageProcessorPil.from_pretrained(self._pretrained)
                               if self._pretrained else Qwen2VLImageProcessorPil(**self._kwargs))
        return self._processor

    def __call__(self, image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        out = self.processor(images=[image], return_tensors="pt")
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        return out["pixel_values"].float(), (t, h, w)


def data_url_bytes(url: str, what: str) -> bytes:
    """The bytes of a base64 data URL of ``what`` ("an image", "a video"); ValueError naming it
    where the URL is not base64."""
    kind = what.split()[-1]
    head, _, data = url.partition(",")
    if not head.endswith(";base64"):
        raise ValueError(f"{what} data URL must be base64 (data:{kind}/...;base64,...)")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"the {kind} data URL is not valid base64") from None
