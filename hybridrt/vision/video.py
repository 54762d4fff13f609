"""Videos for Qwen3.5's vision tower: a video given as frames (PIL images or uint8 arrays, with
vLLM's optional metadata) or as a file (decoded with PyAV, the ``video`` extra, sampled at
``fps`` frames a second up to ``max_frames``) -> its patches through transformers'
``Qwen3VLVideoProcessor``, and the timestamp text the Qwen3-VL processor puts before each
group of ``temporal_patch_size`` frames."""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hybridrt.vision.config import VisionConfig
from hybridrt.vision.preprocess import data_url_bytes, load_image

DEFAULT_FPS = 24  # the Qwen3-VL processor's frame rate for frames given without one


@dataclass(slots=True)
class Video:
    """Sampled frames [T, H, W, 3] uint8, the source's frame rate (None: not known) and each
    frame's index in the source."""

    frames: np.ndarray
    fps: float | None
    indices: list[int]

    def timestamps(self, temporal_patch: int) -> list[float]:
        """The seconds of each group of ``temporal_patch`` frames (the mean of its first and
        last frame; a last group short of frames repeats its last one), as transformers'
        ``Qwen3VLProcessor._calculate_timestamps``."""
        idx = list(self.indices)
        idx += [idx[-1]] * (-len(idx) % temporal_patch)
        fps = self.fps or DEFAULT_FPS
        return [(idx[i] + idx[i + temporal_patch - 1]) / fps / 2
                for i in range(0, len(idx), temporal_patch)]


def is_frame(obj: Any) -> bool:
    """A single frame: a PIL image or an (H, W, C) array."""
    from PIL import Image

    return isinstance(obj, Image.Image) or (isinstance(obj, np.ndarray) and obj.ndim == 3)


def is_video(obj: Any) -> bool:
    """One video (not a list of them): frames, a 4-D array, (frames, metadata), a file."""
    if isinstance(obj, (str, os.PathLike, bytes, bytearray)):
        return True
    if isinstance(obj, np.ndarray):
        return obj.ndim == 4
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], dict):
        return True
    return isinstance(obj, (list, tuple)) and len(obj) > 0 and all(is_frame(f) for f in obj)


def load_video(obj: Any, fps: float, max_frames: int) -> Video:
    """A video from frames (a list of PIL images, (H, W, 3) uint8 arrays or image files as
    ``load_image`` takes them, a (T, H, W, 3) array, or vLLM's (frames, {"fps": ...,
    "frames_indices": [...]})), taken as they are; or from a file (bytes, a ``data:`` URL or a
    local path) sampled at ``fps`` frames a second, at most ``max_frames``. ValueError naming
    what is wrong: no frames, more than ``max_frames`` given, frames of different sizes,
    undecodable bytes."""
    meta: dict = {}
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], dict):
        obj, meta = obj
    if isinstance(obj, (str, os.PathLike, bytes, bytearray)):
        if meta:
            raise ValueError("video metadata goes with frames; a video file carries its own")
        return decode_video(_file_bytes(obj), fps, max_frames)
    frames = _frames(obj)
    if len(frames) > max_frames:
        raise ValueError(f"the video has {len(frames)} frames, over the limit of {max_frames} "
                         f"(video_max_frames / --video-max-frames)")
    indices = meta.get("frames_indices")
    indices = list(range(len(frames))) if indices is None else [int(i) for i in indices]
    if len(indices) != len(frames):
        raise ValueError(f"video metadata frames_indices has {len(indices)} entries for "
                         f"{len(frames)} frames")
    rate = meta.get("fps")
    if rate is not None and not (isinstance(rate, (int, float)) and rate > 0):
        raise ValueError(f"video metadata fps must be a positive number, got {rate!r}")
    return Video(frames, None if rate is None else float(rate), indices)


def _frames(obj: Any) -> np.ndarray:
    from PIL import Image

    if (isinstance(obj, np.ndarray) and obj.ndim == 4) or isinstance(obj, (list, tuple)):
        frames = list(obj)
    else:
        raise ValueError(f"a video must be a list of frames (PIL images or arrays), a (T, H, W, "
                         f"3) array, bytes, a data URL or a path, got {type(obj).__name__}")
    if not frames:
        raise ValueError("the video has no frames")
    out = []
    for i, f in enumerate(frames):
        if isinstance(f, (str, os.PathLike, bytes, bytearray)):
            f = load_image(f)  # an image file's path, bytes or data URL
        if isinstance(f, Image.Image):
            f = np.asarray(f.convert("RGB"))
        if not (isinstance(f, np.ndarray) and f.ndim == 3 and f.shape[2] == 3
                and f.dtype == np.uint8):
            raise ValueError(f"video frame {i} must be a PIL image, an (H, W, 3) uint8 array or "
                             f"an image file")
        if f.shape[0] < 1 or f.shape[1] < 1:
            raise ValueError(f"video frame {i} has no pixels ({f.shape[1]}x{f.shape[0]})")
        if out and f.shape != out[0].shape:
            raise ValueError(f"video frame {i} is {f.shape[1]}x{f.shape[0]}, frame 0 is "
                             f"{out[0].shape[1]}x{out[0].shape[0]}: a video's frames share one "
                             f"size")
        out.append(f)
    return np.stack(out)


def _file_bytes(obj) -> bytes:
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj)
    s = str(obj)
    if s.startswith("data:"):
        return data_url_bytes(s, "a video")
    if "://" in s:
        raise ValueError(f"video {s[:60]!r}: only data URLs and local paths are accepted")
    path = Path(s).expanduser()
    if not path.is_file():
        raise ValueError(f"video file {s!r} does not exist")
    return path.read_bytes()


def _pyav():
    try:
        import av
    except ImportError:
        raise ValueError("decoding a video file needs PyAV: pip install 'hybridrt[video]' (or "
                         "give the video as a list of frames)") from None
    return av


def decode_video(raw: bytes, fps: float, max_frames: int) -> Video:
    """A video file's frames sampled as transformers' ``Qwen3VLVideoProcessor.sample_frames``
    does (``int(frames / source fps * fps)`` of them, at least 4, at most ``max_frames`` and
    the file's frame count, evenly spread), decoded to RGB with PyAV."""
    from PIL import Image

    av = _pyav()
    try:
        with av.open(io.BytesIO(raw)) as c:
            stream = c.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or 0) or None
            total = stream.frames or sum(1 for p in c.demux(stream) if p.size)
            if stream.width * stream.height > (Image.MAX_IMAGE_PIXELS or float("inf")):
                raise ValueError(f"the video's frames are {stream.width}x{stream.height}: "
                                 f"refused, too many pixels")
        if total < 1:
            raise ValueError("the video has no frames")
        n = int(total / (rate or DEFAULT_FPS) * fps)
        n = min(max(n, 4), max_frames, total)
        indices = np.linspace(0, total - 1, n).round().astype(int).tolist()
        wanted, frames = set(indices), {}
        with av.open(io.BytesIO(raw)) as c:
            for i, frame in enumerate(c.decode(video=0)):
                if i in wanted:
                    frames[i] = frame.to_ndarray(format="rgb24")
                if i >= indices[-1]:
                    break
    except (av.FFmpegError, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"the video bytes cannot be decoded as a video: "
                         f"{e or type(e).__name__}") from None
    if len(frames) < len(indices):
        raise ValueError(f"the video ended after {len(frames)} of its {total} frames")
    return Video(np.stack([frames[i] for i in indices]), rate, indices)


def _processor_class():
    """transformers' ``Qwen3VLVideoProcessor`` with its three torchvision calls (resize,
    normalize, grayscale to RGB) made with torch alone: the ops torchvision runs for uint8
    frames on the CPU (``interpolate`` bicubic with antialiasing, ``(x - mean) / std``), so
    the processor needs no torchvision."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_processing_utils import BaseVideoProcessor

    class _TorchOps(BaseVideoProcessor):
        def resize(self, image, size, resample=None, antialias=True, **kwargs):
            *lead, c, h, w = image.shape
            if (size.height, size.width) == (h, w):
                return image
            out = F.interpolate(image.reshape(-1, c, h, w), size=(size.height, size.width),
                                mode="bicubic", align_corners=False, antialias=True)
            return out.reshape(*lead, c, size.height, size.width)

        def normalize(self, image, mean, std, inplace=False, **kwargs):
            mean = torch.as_tensor(mean, dtype=image.dtype).reshape(-1, 1, 1)
            std = torch.as_tensor(std, dtype=image.dtype).reshape(-1, 1, 1)
            return (image - mean) / std

    class TorchQwen3VLVideoProcessor(Qwen3VLVideoProcessor, _TorchOps):
        pass

    return TorchQwen3VLVideoProcessor


class VideoProcessor:
    """One video -> (patches [n, channels * temporal_patch * patch^2] float32, grid (t, h, w)
    in patches): the checkpoint's ``video_preprocessor_config.json`` where it has one (None:
    no checkpoint directory), else
    the processor's defaults with the tower's patch, temporal patch and merge sizes."""

    def __init__(self, model_path: str | os.PathLike | None, cfg: VisionConfig):
        cls = _processor_class()
        path = Path(model_path) if model_path is not None else None
        if path is not None and (path / "video_preprocessor_config.json").is_file():
            self.processor = cls.from_pretrained(str(path))
        else:
            self.processor = cls(patch_size=cfg.patch_size,
                                 temporal_patch_size=cfg.temporal_patch_size,
                                 merge_size=cfg.spatial_merge_size)
        p = self.processor
        if p.cap_pixels_per_frame is None:
            p.cap_pixels_per_frame = False  # transformers' behaviour while it is unset
        if (p.patch_size, p.temporal_patch_size, p.merge_size) != (
                cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size):
            sizes = (p.patch_size, p.temporal_patch_size, p.merge_size)
            raise ValueError(f"video_preprocessor_config.json: patch, temporal patch and merge "
                             f"sizes {sizes} differ from the vision_config's")

    @property
    def temporal_patch(self) -> int:
        return self.processor.temporal_patch_size

    def __call__(self, video: Video) -> tuple[torch.Tensor, tuple[int, int, int]]:
        if len(video.frames) < self.temporal_patch:
            raise ValueError(f"the video has {len(video.frames)} frame(s): a video needs at "
                             f"least {self.temporal_patch} (give a single frame as an image)")
        out = self.processor(videos=[video.frames], return_tensors="pt", do_sample_frames=False,
                             do_convert_rgb=False, return_metadata=False)
        t, h, w = (int(v) for v in out["video_grid_thw"][0])
        return out["pixel_values_videos"].float(), (t, h, w)
