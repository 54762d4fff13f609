"""A loaded vision tower and what it makes of a request: ``VisionTower.prepare`` turns a
prompt's placeholders and images into the expanded prompt and its ``VisionInputs`` (patches,
M-RoPE positions, rope delta, and the merged embeddings, encoded once on first need)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridrt.vision.config import VisionConfig
from hybridrt.vision.encoder import VisionEncoder
from hybridrt.vision.encoder_cache import EncoderCache
from hybridrt.vision.inputs import check_image_count
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
    """One image of a request: where its tokens start in the prompt, its patch grid, its
    patches and their digest (pixels and grid)."""

    offset: int
    grid: tuple[int, int, int]
    pixels: torch.Tensor
    digest: bytes

    def merged_grid(self, merge: int) -> tuple[int, int, int]:
        t, h, w = self.grid
        return t, h // merge, w // merge

    def num_tokens(self, merge: int) -> int:
        t, h, w = self.merged_grid(merge)
        return t * h * w


class VisionInputs:
    """A request's images: the M-RoPE positions of its prompt [3, L], the rope delta of every
    token after the prompt, which prompt tokens are image tokens, and their embeddings
    (``embeddings_at``: each image encoded once per request, on first need, or taken from the
    tower's encoder cache; ``scheduled``: the images the scheduler's encoder budget gave the
    coming step, encoded together at its start, ``hybridrt.vision.budget``)."""

    def __init__(self, tower: VisionTower, items: list[ImageItem], num_tokens: int):
        merge = tower.config.spatial_merge_size
        self.tower, self.items, self.prompt_len = tower, items, num_tokens
        spans = [(it.offset, it.merged_grid(merge)) for it in items]
        self.positions, self.delta = mrope_positions(num_tokens, spans)
        self.embed_row = np.full(num_tokens, -1, dtype=np.int64)
        self.row_start = np.zeros(len(items) + 1, dtype=np.int64)  # image i: rows [i] to [i + 1]
        row = 0
        for i, it in enumerate(items):
            n = it.num_tokens(merge)
            self.embed_row[it.offset:it.offset + n] = np.arange(row, row + n)
            row += n
            self.row_start[i + 1] = row
        self.num_image_tokens = row
        self.num_added = 0  # tokens the placeholders' expansion added to the prompt
        self.embeds: list[torch.Tensor | None] = [None] * len(items)  # per image, once encoded
        self.scheduled: list[int] = []  # images to encode at the coming step's start
        self.encoder_runs = 0  # images of this request the encoder ran for
        self.encoder_cache_hits = 0  # images taken from the tower's encoder cache
        self.preprocess_seconds = 0.0  # decoding and preprocessing the images (in prepare)
        self.encoder_seconds = 0.0  # the encoder's runs for this request's images

    def embeddings_at(self, idx: np.ndarray) -> torch.Tensor:
        """[len(idx), hidden]: the embeddings of the prompt's image tokens ``idx`` (ascending;
        the images they belong to encoded first where they are not yet)."""
        rows = self.embed_row[idx]
        which = np.searchsorted(self.row_start, rows, side="right") - 1
        images = np.unique(which)
        self.tower.encode_images([(self, int(i)) for i in images])
        return torch.cat([self.embeds[i][torch.from_numpy(rows[which == i] - self.row_start[i])]
                          for i in images])

    def images_in(self, start: int, end: int) -> list[int]:
        """The images with tokens in the prompt's positions [start, end), in order."""
        return [i for i, it in enumerate(self.items)
                if it.offset < end and start < it.offset + self.image_tokens(i)]

    def image_tokens(self, i: int) -> int:
        return int(self.row_start[i + 1] - self.row_start[i])

    def held(self, i: int) -> bool:
        """Whether image i's embeddings are at hand (encoded, or now taken from the tower's
        encoder cache)."""
        if self.embeds[i] is None:
            got = self.tower.cache.get(self.items[i].digest)
            if got is not None:
                self.embeds[i] = got
                self.encoder_cache_hits += 1
        return self.embeds[i] is not None

    def metrics(self) -> dict:
        """The request's images, their tokens, how many of them the encoder ran for (0 where
        the prefix cache held every image token or the encoder cache every image) and how
        many the encoder cache gave; the seconds spent preprocessing and encoding them (a run
        that encoded images of several requests counts for each)."""
        return {"num_images": len(self.items), "num_image_tokens": self.num_image_tokens,
                "encoder_runs": self.encoder_runs,
                "encoder_cache_hits": self.encoder_cache_hits,
                "preprocess_seconds": self.preprocess_seconds,
                "encoder_seconds": self.encoder_seconds}

    def keyed(self, ids: Sequence[int]) -> list[int]:
        """The prompt as the request's ``token_ids`` hold it: each image token replaced by a
        negative id drawn from its image's digest (pixels and grid) and its index in the image,
        so that the prefix cache's block hashes and checkpoint keys cover the image's content:
        the same image hits, another one of the same size does not. The runner puts the image
        token's id back before embedding (``hybridrt.vision.step``)."""
        out = list(ids)
        merge = self.tower.config.spatial_merge_size
        for it in self.items:
            base = int.from_bytes(it.digest[:8], "little") & _KEY_MASK
            for i in range(it.num_tokens(merge)):
                out[it.offset + i] = -1 - ((base + i) & _KEY_MASK)
        return out


class VisionTower:
    """The encoder, the image processor and the token ids of one checkpoint, and the most
    images one prompt may hold (``max_images``, None: no limit)."""

    def __init__(self, config: VisionConfig, encoder: VisionEncoder, processor: ImageProcessor,
                 rotary: TextRotary):
        self.config, self.encoder, self.processor, self.rotary = config, encoder, processor, rotary
        self.max_images: int | None = None
        self.cache = EncoderCache(0)  # encoder outputs by image digest (0 bytes: none kept)

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.pos_embed.weight.dtype

    @torch.inference_mode()
    def encode(self, items: Sequence[ImageItem]) -> torch.Tensor:
        pixels = torch.cat([it.pixels for it in items])
        return self.encoder(pixels, [it.grid for it in items])

    def encode_images(self, wanted: Sequence[tuple[VisionInputs, int]]) -> None:
        """Give each (request's images, image index) its embeddings: the held ones as they
        are, the encoder cache's, and the rest encoded in one run (an image that several
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

    def image_item(self, image, offset: int = 0) -> ImageItem:
        pixels, grid = self.processor(load_image(image))
        h = hashlib.sha256(np.asarray(grid, dtype=np.int64).tobytes())
        h.update(pixels.numpy().tobytes())
        return ImageItem(offset, grid, pixels, h.digest())

    def prepare(self, ids: Sequence[int], images: Sequence) -> tuple[list[int], VisionInputs]:
        """The prompt with each image's placeholder (a run of ``<|image_pad|>`` tokens: one, as
        vLLM's prompts hold it, or already the image's token count) expanded to its token
        count -> (ids, inputs). ValueError where the placeholders and images do not pair up,
        or where they are more than ``max_images``."""
        check_image_count(len(images), self.max_images)
        cfg = self.config
        pad = cfg.image_token_id
        if cfg.video_token_id in ids:
            raise ValueError("video is not supported yet: the prompt holds <|video_pad|> tokens")
        runs = _runs(ids, pad)
        if len(runs) != len(images):
            raise ValueError(f"the prompt has {len(runs)} image placeholder(s) "
                             f"(<|vision_start|><|image_pad|><|vision_end|>) for {len(images)} "
                             f"image(s)")
        out: list[int] = []
        items = []
        at = 0
        t0 = time.perf_counter()
        for (start, length), image in zip(runs, images):
            item = self.image_item(image)
            n = item.num_tokens(cfg.spatial_merge_size)
            if length not in (1, n):
                raise ValueError(f"an image placeholder of {length} <|image_pad|> tokens for an "
                                 f"image of {n} tokens: give one <|image_pad|> per image")
            out += ids[at:start]
            item.offset = len(out)
            out += [pad] * n
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
                             f"images were given (pass them in multi_modal_data)")

    def rope_rows(self, positions: torch.Tensor, dtype: torch.dtype):
        r = self.rotary
        return mrope_cos_sin(positions, r.rotary_dim, r.theta, r.section, dtype, r.scaling)


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
