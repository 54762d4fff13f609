"""Open a GGUF file and check it before anything is allocated: the magic, the header, the
architecture, every tensor inside the file. Tensors stay memory-mapped (``gguf.GGUFReader``
in copy-on-write mode: no copy of the file, and torch may wrap the pages without a read-only
warning)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from hybridrt.gguf import GGUF_MAGIC

ARCHITECTURES = ("qwen35",)  # what this reader loads; qwen35moe and mmproj files are refused


class GGUFError(ValueError):
    """A GGUF file hybridrt cannot load (one line naming the file and what is wrong)."""


def _raised_in(e: BaseException, function: str) -> bool:
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False


class GGUFFile:
    """One opened GGUF file: ``metadata`` (key -> Python value), ``tensors`` (name ->
    ``gguf.ReaderTensor``, data memory-mapped), ``arch`` and ``path``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        try:
            size = self.path.stat().st_size
            with self.path.open("rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot read ({e.strerror or e})") from None
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected "
                            f"{GGUF_MAGIC!r})")
        from gguf import GGUFReader

        try:
            reader = GGUFReader(self.path, "c")
        except Exception as e:  # noqa: BLE001 - the reader raises many kinds on a bad header
            if _raised_in(e, "_build_tensors"):  # the header parsed; the data is not all there
                raise GGUFError(f"{self.path}: truncated: the tensor data runs past the end of "
                                f"the file ({size} bytes)") from None
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GGUFError(f"{self.path}: malformed or truncated GGUF header ({why})") from None
        self._reader = reader
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception as e:  # noqa: BLE001
                raise GGUFError(f"{self.path}: metadata {key!r} cannot be read ({e})") from None
        self.arch = self.metadata.get("general.architecture")
        if self.arch not in ARCHITECTURES:
            kind = self.metadata.get("general.type")
            what = f"a {kind} file of" if kind and kind != "model" else "architecture"
            raise GGUFError(f"{self.path}: {what} {self.arch!r} is not one hybridrt loads "
                            f"(it loads {', '.join(ARCHITECTURES)})")
        self.tensors = {}
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size or t.data.nbytes != int(t.n_bytes):
                raise GGUFError(f"{self.path}: truncated: tensor {t.name} ends at byte {end}, "
                                f"the file has {size}")
            self.tensors[t.name] = t

    def get(self, key: str, default: Any = None) -> Any:
        """``{arch}.key`` (a key without a dot in front: the architecture's) or a full key."""
        if key.startswith(("general.", "tokenizer.")):
            return self.metadata.get(key, default)
        return self.metadata.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata {self.arch}.{key} is missing")
        return value

    @staticmethod
    def shape(tensor) -> tuple[int, ...]:
        """A tensor's shape in torch's order (GGUF writes the dimensions innermost first)."""
        return tuple(int(n) for n in reversed(np.asarray(tensor.shape).tolist()))
