"""Every option of an engine in one dataclass, checked once (``EngineArgs``).

``LLM(model, **options)`` builds one ``EngineArgs`` from its keywords; the options that depend
on the model (``max_model_len``, ``max_num_batched_tokens``) are filled once it is loaded
(``resolved``), and the engine, its runner, scheduler and cache take that resolved copy whole.
The range checks (``check_int``, ``check_number``, ``check_bool``) are the ones every option of
the engine goes through. Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from hybridrt.options import (
    check_device_name,
    check_kv_cache_dtype,
    check_quantization,
    parse_memory,
)
from hybridrt.specdec.methods import check_method, uses_mtp
from hybridrt.vision.encoder_cache import parse_cache_bytes
from hybridrt.vision.inputs import parse_mm_limits


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None,
              hint: str = "") -> int:
    """``value`` if it is an int (not a bool) in [lo, hi] -> it; else ValueError
    "``name`` must be ... got ``value``" (``hint`` follows the range)."""
    if (not isinstance(value, int) or isinstance(value, bool)
            or (lo is not None and value < lo) or (hi is not None and value > hi)):
        if hi is not None:
            want = f"an integer in [{lo}, {hi}]"
        elif lo == 1:
            want = "a positive integer"
        else:
            want = "an integer" if lo is None else f"an integer >= {lo}"
        raise ValueError(f"{name} must be {want}{hint}, got {value!r}")
    return value


def check_number(name: str, value: Any, lo: float, hi: float) -> float:
    """``value`` if it is a number (not a bool) in [lo, hi) -> it; else ValueError."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not lo <= value < hi):
        raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}), got {value!r}")
    return value


def parse_overrides(value: Any) -> dict | None:
    """hf_overrides: a dict, or its JSON text (``--hf-overrides``) -> the dict; otherwise a
    one-line ValueError."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"hf_overrides is not valid JSON: {e}") from None
        if isinstance(value, dict):
            return value
    raise ValueError(f"hf_overrides must be a JSON object of config.json entries, got "
                     f"{value!r}")


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is True or False -> it; else ValueError."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_mmproj(model: Any, mmproj: Any) -> None:
    """``mmproj`` (a vision projector file) is None or an existing file beside a GGUF
    ``model``; otherwise a one-line ValueError."""
    if mmproj is None:
        return
    from hybridrt.gguf import is_gguf_path

    if not isinstance(mmproj, (str, os.PathLike)) or not os.path.isfile(mmproj):
        raise ValueError(f"mmproj must be the path of a projector file, got {mmproj!r}")
    if model is None or not is_gguf_path(model):
        raise ValueError(f"mmproj is a GGUF model's vision projector, but model {model!r} is "
                         f"not a GGUF file (a checkpoint's tower is its model.visual.* weights)")


def default_batched_tokens(device, block_size: int, max_model_len: int) -> int:
    """The default token budget of a step: 8192 on CUDA (a long prompt in a few steps, like
    vLLM's GPU defaults), 512 on CPU; at least a block, at most the context length."""
    per_step = 8192 if device.type == "cuda" else 512
    return min(max(per_step, block_size), max_model_len)


@dataclass(frozen=True)
class EngineArgs:
    """The options of ``LLM`` (its docstring says what each means), with its defaults."""

    model: str | os.PathLike | None = None
    dtype: Any = "auto"  # str or torch.dtype
    max_model_len: int | None = None  # None: min(the model's max_position_embeddings, 4096)
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None  # None: default_batched_tokens
    block_size: int = 16
    cache_memory: int | float | str | None = None
    seed: int | None = 0
    tokenizer: Any = "auto"
    device: Any = "cpu"  # str or torch.device
    speculative_tokens: int = 0
    backend: str | None = None
    max_num_sessions: int = 64
    threads: int | None = None
    draft_vocab_size: int | None = None
    quantization: str | None = None
    async_scheduling: bool | None = None  # None: on for CUDA
    enable_prefix_caching: bool = True
    checkpoint_interval: int = 2048
    checkpoint_share: float = 0.25
    batch_invariant: bool = False
    trace: bool = False  # a TraceRecorder on the engine's observer (hybridrt.trace)
    hf_overrides: dict | str | None = None  # config.json entries replaced (JSON text or dict)
    language_model_only: bool = False  # the vision tower stays on disk (hybridrt.vision)
    speculative_method: str = "mtp"
    speculative_adaptive: bool = False
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    prefix_cache_dir: str | os.PathLike | None = None
    prefix_cache_dir_size: int | str = "16GiB"
    kv_cache_dtype: str = "auto"  # hybridrt.options.KV_CACHE_DTYPES
    mmproj: str | os.PathLike | None = None  # a GGUF model's projector (hybridrt.gguf.mmproj)
    vision_quantization: str | None = None  # the vision tower's linears (hybridrt.vision.kernels)
    limit_mm_per_prompt: dict | str | None = None  # {"image": N} (hybridrt.vision.inputs)
    video_fps: float = 2.0  # a video file's frames sampled a second (hybridrt.vision.video)
    video_max_frames: int = 32  # the most frames of one video (sampled or given)
    encoder_cache_memory: int | str = "256MiB"  # hybridrt.vision.encoder_cache; 0: none

    def __post_init__(self) -> None:
        object.__setattr__(self, "hf_overrides", parse_overrides(self.hf_overrides))
        object.__setattr__(self, "limit_mm_per_prompt",
                           parse_mm_limits(self.limit_mm_per_prompt))
        check_mmproj(self.model, self.mmproj)
        if isinstance(self.video_fps, bool) or not isinstance(self.video_fps, (int, float)) \
                or not self.video_fps > 0:
            raise ValueError(f"video_fps must be a positive number, got {self.video_fps!r}")
        check_int("video_max_frames", self.video_max_frames, lo=1)
        parse_cache_bytes(self.encoder_cache_memory)
        check_int("speculative_tokens", self.speculative_tokens, lo=0)
        check_speculation(self)
        check_int("max_num_sessions", self.max_num_sessions, lo=0)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_int("checkpoint_interval", self.checkpoint_interval, lo=0)
        check_number("checkpoint_share", self.checkpoint_share, 0, 1)
        if self.prefix_cache_dir is not None:
            if not self.enable_prefix_caching:
                raise ValueError("prefix_cache_dir is the prefix cache's disk tier: it needs "
                                 "enable_prefix_caching=True")
            try:
                size = parse_memory(self.prefix_cache_dir_size)[0]
            except ValueError:
                size = None
            if size is None or isinstance(self.prefix_cache_dir_size, float):
                raise ValueError(f"prefix_cache_dir_size must be bytes or a size such as "
                                 f"'16GiB', got {self.prefix_cache_dir_size!r}")
        if self.draft_vocab_size is not None:
            check_int("draft_vocab_size", self.draft_vocab_size, lo=1)
            if self.speculative_tokens == 0:
                raise ValueError("draft_vocab_size is for MTP drafts: it needs "
                                 "speculative_tokens > 0")
            if not uses_mtp(self.speculative_method):
                raise ValueError(f"draft_vocab_size is for MTP drafts: speculative_method "
                                 f"{self.speculative_method!r} drafts none")
        if self.threads is not None:
            check_int("threads", self.threads, lo=1)
        if isinstance(self.device, str):
            check_device_name(self.device)
        check_bool("batch_invariant", self.batch_invariant)
        check_bool("trace", self.trace)
        check_bool("language_model_only", self.language_model_only)
        if self.batch_invariant and self.backend == "reference":
            raise ValueError("batch_invariant=True runs on the cpu and cuda backends, not the "
                             "reference one")
        object.__setattr__(self, "quantization", check_quantization(self.quantization))
        object.__setattr__(self, "vision_quantization",
                           check_vision_quantization(self.vision_quantization))
        if self.vision_quantization and self.language_model_only:
            raise ValueError("vision_quantization quantizes the vision tower, which "
                             "language_model_only leaves unloaded: give one of them")
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, lo=2)
        check_int("max_num_seqs", self.max_num_seqs, lo=1)
        if self.max_num_batched_tokens is not None:
            check_int("max_num_batched_tokens", self.max_num_batched_tokens, lo=1)
        check_int("block_size", self.block_size, lo=1)
        parse_memory(self.cache_memory)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_cache_dtype == "int8" and (str(self.device).startswith("cuda")
                                              or self.backend in ("cuda", "triton")):
            raise ValueError("kv_cache_dtype='int8' runs on the CPU backends only")

    @property
    def image_limit(self) -> int | None:
        """The most images one prompt may hold (``limit_mm_per_prompt``; None: no limit)."""
        return (self.limit_mm_per_prompt or {}).get("image")

    @property
    def video_settings(self) -> dict:
        """The vision tower's video settings (hybridrt.vision.tower.VisionTower)."""
        return {"max_videos": (self.limit_mm_per_prompt or {}).get("video"),
                "video_fps": float(self.video_fps), "video_max_frames": self.video_max_frames}

    @property
    def mtp_drafts(self) -> bool:
        """Whether the drafts need the checkpoint's MTP layer (it is loaded then)."""
        return self.speculative_tokens > 0 and uses_mtp(self.speculative_method)

    def check_mtp_weights(self, has_mtp: bool, path) -> None:
        """ValueError when the drafts need MTP weights the checkpoint at ``path`` lacks."""
        if self.mtp_drafts and not has_mtp:
            raise ValueError(
                f"speculative_tokens={self.speculative_tokens} needs MTP weights, but the "
                f"checkpoint at {path} has no mtp.* tensors (use speculative_tokens=0, or "
                f"speculative_method='ngram')")

    def resolved(self, max_position_embeddings: int, device) -> EngineArgs:
        """A copy with the model-dependent defaults filled for a model whose context is
        ``max_position_embeddings`` tokens, on ``device`` (a torch.device, which it holds)."""
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = min(max_position_embeddings, 4096)
        if max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {max_position_embeddings}")
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = default_batched_tokens(device, self.block_size, max_model_len)
        return dataclasses.replace(self, device=device, max_model_len=max_model_len,
                                   max_num_batched_tokens=batched)

    @property
    def async_scheduling_on(self) -> bool:
        """Whether decode steps are chained (``async_scheduling``; default: on for CUDA)."""
        if self.async_scheduling is None:
            return str(self.device).startswith("cuda")
        return bool(self.async_scheduling)


def check_speculation(args: EngineArgs) -> None:
    """speculative_method, speculative_adaptive and prompt_lookup_min / max (specdec)."""
    check_method(args.speculative_method)
    check_bool("speculative_adaptive", args.speculative_adaptive)
    check_int("prompt_lookup_min", args.prompt_lookup_min, lo=1)
    check_int("prompt_lookup_max", args.prompt_lookup_max, lo=args.prompt_lookup_min,
              hint=" (at least prompt_lookup_min)")


def check_device(device):
    """-> the torch.device; ValueError saying why when it cannot run here (checked before
    anything loads)."""
    import torch

    if isinstance(device, str):
        check_device_name(device)
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {str(device)!r}")
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise ValueError(f"CUDA is not available in this PyTorch build (torch "
                             f"{torch.__version__} is CPU-only): use the CPU, or install a "
                             f"CUDA build of torch")
        raise ValueError(f"CUDA is not available: torch {torch.__version__} is built for CUDA "
                         f"{torch.version.cuda} but sees no usable GPU (driver? "
                         f"CUDA_VISIBLE_DEVICES?)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"no device {device}: {torch.cuda.device_count()} GPU(s) visible")
    return device


def check_vision_quantization(name) -> str | None:
    """None / 'none' -> None, 'int8' -> it; int4 is refused (the tower's embeddings were about
    18% off in 4 bits: docs/vision.md), anything else as ``check_quantization`` refuses it."""
    name = check_quantization(name)
    if name == "int4":
        raise ValueError("vision_quantization='int4' is not offered: the tower's embeddings "
                         "were about 18% off in 4 bits (docs/vision.md); use int8 or none")
    return name


def check_cpu_backend(what: str, device, backend: str | None) -> None:
    """Quantized weights run on the CPU backends only: ValueError naming ``what`` otherwise."""
    if device.type != "cpu" or backend not in (None, "cpu", "reference"):
        raise ValueError(f"{what} runs on the CPU backends only, not device={str(device)!r} "
                         f"backend={backend!r}")


def check_call_speculative_tokens(k, limit: int) -> None:
    """A bad speculative_tokens of one call (``LLM.generate(..., speculative_tokens=k)``) fails
    the call (ValueError), before any request is queued; per-request errors are for
    per-request data. ``limit``: the LLM's own speculative_tokens."""
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= limit):
        hint = (f" (the LLM was built with speculative_tokens={limit}: build it with a larger "
                f"value to draft more)") if isinstance(k, int) and k > limit else ""
        raise ValueError(f"speculative_tokens must be an integer in [0, {limit}], got "
                         f"{k!r}{hint}")
