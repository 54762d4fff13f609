"""A loaded vision tower and what it makes of a request: ``VisionTower.prepare`` turns a
prompt's placeholders, images and videos into the expanded prompt and its ``VisionInputs``
(patches, M-RoPE positions, rope delta, and each item's merged embeddings, encoded once on
first need)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridrt.vision.config import VisionConfig
from hybridrt.vision.encoder import VisionEncoder
from hybridrt.vision.encoder_cache import EncoderCache
from hybridrt.vision.inputs import check_media_count
from hybridrt.vision.positions import mrope_cos_sin, mrope_positions
from hybridrt.vision.preprocess import ImageProcessor, load_image

_KEY_MASK = (1 << 62) - 1  # keyed image-token ids stay within int64 (the block hash packs them)


@dataclass(frozen=True, slots=True)
class TextRotary:
    """The text model's rotary settings M-RoPE rows are computed with."""

    rotary_dim: int
    theta: float
    section: tuple[int, ...]
    scaling: object = None  # YaRN (hybridrt.kernels.rope.RopeScaling) or None


@dataclass(slots=True)
class ImageItem:
    """One image or video of a request: its patch grid, its patches, their digest (pixels and
    grid), its pad token, and where its tokens start in the prompt: one run for an image, one
    per group of ``temporal_patch_size`` frames for a video (timestamp text between them)."""

    grid: tuple[int, int, int]
    pixels: torch.Tensor
    digest: bytes
    token_id: int
    video: bool = False
    starts: list[int] = field(default_factory=list)

    def spans(self, merge: int) -> list[tuple[int, tuple[int, int, int]]]:
        """(first token, merged grid) of each run of its tokens: a video's frame groups are
        one-frame grids each, as transformers' ``get_rope_index`` splits them."""
        t, h, w = self.grid
        if self.video:
            return [(s, (1, h // merge, w // merge)) for s in self.starts]
        return [(self.starts[0], (t, h // merge, w // merge))]

    def run_tokens(self, merge: int) -> int:
        """Tokens in one run (an image's, or one frame group's)."""
        t, h, w = self.grid
        return (1 if self.video else t) * (h // merge) * (w // merge)

    def num_tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * (h // merge) * (w // merge)


class VisionInputs:
    """A request's images and videos: the M-RoPE positions of its prompt [3, L], the rope delta
    of every token after the prompt, which prompt tokens are image or video tokens, and their
    embeddings, kept per item (``embeddings_at``: each image or video encoded once per request,
    on first need, or taken from the tower's encoder cache; ``scheduled``: the items the
    scheduler's encoder budget gave the coming step, encoded together at its start,
    ``hybridrt.vision.budget``)."""

    def __init__(self, tower: VisionTower, items: list[ImageItem], num_tokens: int):
        merge = tower.config.spatial_merge_size
        self.tower, self.items, self.prompt_len = tower, items, num_tokens
        spans = [span for it in items for span in it.spans(merge)]
        self.positions, self.delta = mrope_positions(num_tokens, spans)
        self.embed_row = np.full(num_tokens, -1, dtype=np.int64)
        self.row_start = np.zeros(len(items) + 1, dtype=np.int64)  # item i: rows [i] to [i + 1]
        row_token = []  # each embedding row's pad token id
        for i, it in enumerate(items):
            n = it.run_tokens(merge)
            for start, _ in it.spans(merge):
                self.embed_row[start:start + n] = np.arange(len(row_token), len(row_token) + n)
                row_token += [it.token_id] * n
            self.row_start[i + 1] = len(row_token)
        self.row_token = np.asarray(row_token, dtype=np.int64)
        self.num_image_tokens = len(row_token)
        self.num_added = 0  # tokens the placeholders' expansion added to the prompt
        self.embeds: list[torch.Tensor | None] = [None] * len(items)  # per item, once encoded
        self.scheduled: list[int] = []  # items to encode at the coming step's start
        self.encoder_runs = 0  # items of this request the encoder ran for
        self.encoder_cache_hits = 0  # items taken from the tower's encoder cache
        self.preprocess_seconds = 0.0  # decoding and preprocessing the items (in prepare)
        self.encoder_seconds = 0.0  # the encoder's runs for this request's items

    def embeddings_at(self, idx: np.ndarray) -> torch.Tensor:
        """[len(idx), hidden]: the embeddings of the prompt's image and video tokens ``idx``
        (ascending; the items they belong to encoded first where they are not yet)."""
        rows = self.embed_row[idx]
        which = np.searchsorted(self.row_start, rows, side="right") - 1
        images = np.unique(which)
        self.tower.encode_images([(self, int(i)) for i in images])
        return torch.cat([self.embeds[i][torch.from_numpy(rows[which == i] - self.row_start[i])]
                          for i in images])

    def pad_ids(self, idx: np.ndarray) -> torch.Tensor:
        """The pad token ids (``<|image_pad|>`` or ``<|video_pad|>``) of the prompt's image and
        video tokens ``idx``: what the runner embeds in place of their content keys."""
        return torch.from_numpy(self.row_token[self.embed_row[idx]])

    def images_in(self, start: int, end: int) -> list[int]:
        """The images and videos with tokens in the prompt's positions [start, end), in
        order (a video's frame groups each a run of tokens)."""
        merge = self.tower.config.spatial_merge_size
        return [i for i, it in enumerate(self.items)
                if any(s < end and start < s + it.run_tokens(merge) for s in it.starts)]

    def image_tokens(self, i: int) -> int:
        """Item i's tokens (every frame group's for a video): its encoder cost."""
        return int(self.row_start[i + 1] - self.row_start[i])

    def held(self, i: int) -> bool:
        """Whether item i's embeddings are at hand (encoded, or now taken from the tower's
        encoder cache)."""
        if self.embeds[i] is None:
            got = self.tower.cache.get(self.items[i].digest)
            if got is not None:
                self.embeds[i] = got
                self.encoder_cache_hits += 1
        return self.embeds[i] is not None

    def metrics(self) -> dict:
        """The request's images and videos, their tokens, how many of them the encoder ran for
        (0 where the prefix cache held every one of their tokens or the encoder cache every
        item) and how many the encoder cache gave; the seconds spent preprocessing and encoding
        them (a run that encoded items of several requests counts for each)."""
        merge = self.tower.config.spatial_merge_size
        videos = [it for it in self.items if it.video]
        video_tokens = sum(it.num_tokens(merge) for it in videos)
        return {"num_images": len(self.items) - len(videos),
                "num_image_tokens": self.num_image_tokens - video_tokens,
                "num_videos": len(videos), "num_video_tokens": video_tokens,
                "encoder_runs": self.encoder_runs,
                "encoder_cache_hits": self.encoder_cache_hits,
                "preprocess_seconds": self.preprocess_seconds,
                "encoder_seconds": self.encoder_seconds}

    def keyed(self, ids: Sequence[int]) -> list[int]:
        """The prompt as the request's ``token_ids`` hold it: each image or video token
        replaced by a negative id drawn from its item's digest (pixels and grid) and its index
        in the item, so that the prefix cache's block hashes and checkpoint keys cover the
        content: the same image or video hits, another one of the same size does not. The
        runner puts the pad token's id back before embedding (``hybridrt.vision.step``)."""
        out = list(ids)
        merge = self.tower.config.spatial_merge_size
        for it in self.items:
            base = int.from_bytes(it.digest[:8], "little") & _KEY_MASK
            n, i = it.run_tokens(merge), 0
            for start, _ in it.spans(merge):
                for j in range(n):
                    out[start + j] = -1 - ((base + i) & _KEY_MASK)
                    i += 1
        return out


class VisionTower:
    """The encoder, the image and video processors and the token ids of one checkpoint, the
    most images and videos one prompt may hold (``max_images``, ``max_videos``; None: no
    limit) and how video files are sampled (``video_fps`` frames a second, at most
    ``video_max_frames``, also the most frames a video given as frames may have)."""

    def __init__(self, config: VisionConfig, encoder: VisionEncoder, processor: ImageProcessor,
                 rotary: TextRotary, model_path: str | os.PathLike | None = None):
        self.config, self.encoder, self.processor, self.rotary = config, encoder, processor, rotary
        self.model_path = model_path  # where video_preprocessor_config.json is looked for
        self.max_images: int | None = None
        self.max_videos: int | None = None
        self.video_fps, self.video_max_frames = 2.0, 32
        self._video_processor = None
        self.cache = EncoderCache(0)  # encoder outputs by item digest (0 bytes: none kept)

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.pos_embed.weight.dtype

    @torch.inference_mode()
    def encode(self, items: Sequence[ImageItem]) -> torch.Tensor:
        pixels = torch.cat([it.pixels for it in items])
        return self.encoder(pixels, [it.grid for it in items])

    def encode_images(self, wanted: Sequence[tuple[VisionInputs, int]]) -> None:
        """Give each (request's inputs, image or video index) its embeddings: the held ones as
        they are, the encoder cache's, and the rest encoded in one run (an item that several
        requests hold, once), each then put in the encoder cache."""
        todo: dict[bytes, list[tuple[VisionInputs, int]]] = {}
        for v, i in wanted:
            if not v.held(i):
                todo.setdefault(v.items[i].digest, []).append((v, i))
        if not todo:
            return
        firsts = [holders[0] for holders in todo.values()]
        t0 = time.perf_counter()
        out = self.encode([v.items[i] for v, i in firsts])
        seconds = time.perf_counter() - t0
        for v in {id(w): w for holders in todo.values() for w, _ in holders}.values():
            v.encoder_seconds += seconds
        sizes = [v.image_tokens(i) for v, i in firsts]
        for (v, i), embeds in zip(firsts, torch.split(out, sizes)):
            embeds = embeds.clone() if len(firsts) > 1 else embeds  # its own storage
            self.cache.put(v.items[i].digest, embeds)
            for w, j in todo[v.items[i].digest]:
                w.embeds[j] = embeds
                w.encoder_runs += 1

    def image_item(self, image) -> ImageItem:
        pixels, grid = self.processor(load_image(image))
        return ImageItem(grid, pixels, _digest(b"", grid, pixels), self.config.image_token_id)

    def video_item(self, video) -> tuple[ImageItem, list[float]]:
        """A video (``hybridrt.vision.video.load_video``'s forms) -> its item and the seconds
        of its frame groups."""
        from hybridrt.vision.video import VideoProcessor, load_video

        if self._video_processor is None:
            self._video_processor = VideoProcessor(self.model_path, self.config)
        proc = self._video_processor
        clip = load_video(video, self.video_fps, self.video_max_frames)
        pixels, grid = proc(clip)
        item = ImageItem(grid, pixels, _digest(b"video", grid, pixels),
                         self.config.video_token_id, video=True)
        return item, clip.timestamps(proc.temporal_patch)

    def prepare(self, ids: Sequence[int], images: Sequence, videos: Sequence = (),
                tokenize: Callable[[str], list[int]] | None = None
                ) -> tuple[list[int], VisionInputs]:
        """The prompt with each image's placeholder (a run of ``<|image_pad|>`` tokens: one, as
        vLLM's prompts hold it, or already the image's token count) expanded to its token
        count, and each video's ``<|vision_start|><|video_pad|><|vision_end|>`` (or a bare
        ``<|video_pad|>``) to the Qwen3-VL processor's text: per frame group ``<t seconds>``
        (``tokenize``d), vision start, its tokens, vision end -> (ids, inputs). ValueError
        where the placeholders and the media do not pair up, or where they are more than
        ``max_images`` / ``max_videos``."""
        check_media_count("image", len(images), self.max_images)
        check_media_count("video", len(videos), self.max_videos)
        cfg = self.config
        runs = sorted([(s, n, False) for s, n in _runs(ids, cfg.image_token_id)]
                      + [(s, n, True) for s, n in _runs(ids, cfg.video_token_id)])
        for kind, given, video in (("image", images, False), ("video", videos, True)):
            have = sum(1 for r in runs if r[2] == video)
            if have != len(given):
                pad = "video_pad" if video else "image_pad"
                raise ValueError(f"the prompt has {have} {kind} placeholder(s) (<|vision_start|>"
                                 f"<|{pad}|><|vision_end|>) for {len(given)} {kind}(s)")
        if videos and tokenize is None:
            raise ValueError("a video's timestamps are text: it needs the model's tokenizer")
        image_iter, video_iter = iter(images), iter(videos)
        out: list[int] = []
        items = []
        at = 0
        t0 = time.perf_counter()
        for start, length, video in runs:
            if video:
                item, seconds = self.video_item(next(video_iter))
                if length != 1:
                    raise ValueError(f"a video placeholder of {length} <|video_pad|> tokens: "
                                     f"give one <|video_pad|> per video")
                end = start + 1
                if start > at and ids[start - 1] == cfg.vision_start_token_id \
                        and end < len(ids) and ids[end] == cfg.vision_end_token_id:
                    start, end = start - 1, end + 1  # the processor's text brings its own
                out += ids[at:start]
                n = item.run_tokens(cfg.spatial_merge_size)
                for t in seconds:
                    out += tokenize(f"<{t:.1f} seconds>")
                    item.starts.append(len(out) + 1)
                    out += [cfg.vision_start_token_id] + [cfg.video_token_id] * n \
                        + [cfg.vision_end_token_id]
                at = end
            else:
                item = self.image_item(next(image_iter))
                n = item.num_tokens(cfg.spatial_merge_size)
                if length not in (1, n):
                    raise ValueError(f"an image placeholder of {length} <|image_pad|> tokens "
                                     f"for an image of {n} tokens: give one <|image_pad|> per "
                                     f"image")
                out += ids[at:start]
                item.starts.append(len(out))
                out += [cfg.image_token_id] * n
                at = start + length
            items.append(item)
        out += ids[at:]
        inputs = VisionInputs(self, items, len(out))
        inputs.num_added = len(out) - len(ids)
        inputs.preprocess_seconds = time.perf_counter() - t0
        return out, inputs

    def check_text_only(self, ids: Sequence[int]) -> None:
        """A prompt given without images must not hold image or video tokens: they would be
        read as text (ValueError naming them)."""
        cfg = self.config
        n = sum(1 for t in ids if t == cfg.image_token_id or t == cfg.video_token_id)
        if n:
            raise ValueError(f"the prompt holds {n} image/video placeholder token(s) but no "
                             f"images or videos were given (pass them in multi_modal_data)")

    def rope_rows(self, positions: torch.Tensor, dtype: torch.dtype):
        r = self.rotary
        return mrope_cos_sin(positions, r.rotary_dim, r.theta, r.section, dtype, r.scaling)


def _digest(kind: bytes, grid: tuple[int, int, int], pixels: torch.Tensor) -> bytes:
    """sha256 of the item's kind (empty for an image), grid and preprocessed pixels."""
    h = hashlib.sha256(kind)
    h.update(np.asarray(grid, dtype=np.int64).tobytes())
    h.update(pixels.numpy().tobytes())
    return h.digest()


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of ``token`` in ``ids``."""
    runs, i, n = [], 0, len(ids)
    while i < n:
        if ids[i] == token:
            j = i
            while j < n and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs
