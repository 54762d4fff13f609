"""Open a GGUF file and check it before anything is allocated: the magic, the header, the
architecture, every tensor inside the file. Tensors stay memory-mapped (one copy-on-write
``numpy.memmap`` of the file: no copy, and torch may wrap the pages without a read-only
warning).

The header is parsed here rather than by ``gguf.GGUFReader`` (whose constants, quantization
sizes and dequantizers are used): the reader builds a numpy view per element of every array,
and a Qwen3.5 file's 248k-token vocabulary and merges took it 48 s to open on this project's
machine (0.8B shape, under load); this parser reads the same header in well under a second.

A process parses a file's header once: the config, the weights, the tokenizer and each
``generate`` call's default sampling settings all open the file, and the parsed header of the
last two files (key: path, size, modification time) is kept. What it keeps is small: arrays
longer than ``_BIG`` (the vocabulary, its merges and token types, 20-40 MB as Python objects)
are skipped and read from the mapped file when asked for (``_Deferred``).
"""

from __future__ import annotations

import os
import struct
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridrt.gguf import GGUF_MAGIC

ARCHITECTURES = ("qwen35", "qwen35moe")  # what this reader loads as a model
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # GGUFValueType -> struct format
_STRING, _ARRAY = 8, 9
_BIG = 4096  # longer arrays are read when asked for, not kept with a parsed header
_HEADERS: OrderedDict[tuple, tuple] = OrderedDict()  # (path, size, mtime) -> parsed header
_KEEP = 2  # headers kept (a model and its mmproj)


class GGUFError(ValueError):
    """A GGUF file hybridrt cannot load (one line naming the file and what is wrong)."""


@dataclass
class Tensor:
    """One tensor of the file: ``name``, ``tensor_type`` (``gguf.GGMLQuantizationType``),
    ``shape`` (GGUF order, innermost first), ``data`` (a numpy view of the mapped file:
    F32 / F16 values, else the raw bytes per row), ``data_offset``, ``n_bytes``."""

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    data: np.ndarray
    data_offset: int
    n_bytes: int


class _Cursor:
    """Reads little-endian GGUF values from a buffer, refusing any read past its end."""

    def __init__(self, buf, size: int, defer: bool = False):
        self.buf, self.size, self.at, self.defer = buf, size, 0, defer

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        if self.at + n > self.size:
            raise ValueError(f"the header ends early (byte {self.at} of {self.size})")
        value = struct.unpack_from(fmt, self.buf, self.at)[0]
        self.at += n
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.at + n > self.size:
            raise ValueError(f"a string of {n} bytes at byte {self.at} runs past the end")
        text = str(self.buf[self.at:self.at + n], "utf-8", "replace")
        self.at += n
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind != _ARRAY:
            raise ValueError(f"unknown value type {kind} at byte {self.at}")
        item, count = self.take("<I"), self.take("<Q")
        if self.defer and count > _BIG and item in (_STRING, *_SCALARS):
            at = self.at
            return _Deferred(at, item, count, self._skip(item, count), self.at)
        return self.array(item, count)

    def array(self, item: int, count: int) -> list:
        if item in _SCALARS and item != 7:
            dtype = np.dtype(_SCALARS[item])
            if self.at + count * dtype.itemsize > self.size:
                raise ValueError(f"an array of {count} values runs past the end")
            values = np.frombuffer(self.buf, dtype, count, self.at).tolist()
            self.at += count * dtype.itemsize
            return values
        if count > self.size - self.at:
            raise ValueError(f"an array of {count} items runs past the end")
        if item == _STRING:  # vocabularies and merges: hundreds of thousands
            return self._strings(count)
        saved, self.defer = self.defer, False  # only a top-level array is deferred
        try:
            return [self.value(item) for _ in range(count)]
        finally:
            self.defer = saved

    def _skip(self, item: int, count: int) -> np.ndarray | None:
        """Move past an array; a string array's item offsets (each at its length field)."""
        if item != _STRING:
            n = count * struct.calcsize(_SCALARS[item])
            if self.at + n > self.size:
                raise ValueError(f"an array of {count} values runs past the end")
            self.at += n
            return None
        buf, at, size = self.buf, self.at, self.size
        unpack = struct.Struct("<Q").unpack_from
        offsets = array("q")
        for _ in range(count):
            if at + 8 > size:
                raise ValueError(f"the header ends early (byte {at} of {size})")
            offsets.append(at)
            at += 8 + unpack(buf, at)[0]
        if at > size:
            raise ValueError(f"a string at byte {at} runs past the end")
        self.at = at
        return np.frombuffer(offsets, np.int64)

    def _strings(self, count: int) -> list[str]:
        buf, at, size, out = self.buf, self.at, self.size, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if at + 8 > size:
                raise ValueError(f"the header ends early (byte {at} of {size})")
            (n,) = unpack(buf, at)
            at += 8
            if at + n > size:
                raise ValueError(f"a string of {n} bytes at byte {at} runs past the end")
            out.append(str(buf[at:at + n], "utf-8", "replace"))
            at += n
        self.at = at
        return out


@dataclass(frozen=True)
class _Deferred:
    """An array of the header not kept with it: ``count`` items of type ``item`` at byte
    ``at`` (checked to lie inside the file when the header was parsed)."""

    at: int
    item: int
    count: int
    offsets: np.ndarray | None  # a string array's: each item's byte offset
    end: int

    def read(self, buf, size: int) -> list:
        cur = _Cursor(buf, size)
        cur.at = self.at
        return cur.array(self.item, self.count)

    def find(self, buf, texts) -> list[int]:
        """The indices of a string array's items equal to one of ``texts``, ascending."""
        region, found = bytes(buf[self.at:self.end]), []
        for text in texts:
            raw = text.encode()
            pattern = struct.pack("<Q", len(raw)) + raw
            pos = region.find(pattern)
            while pos >= 0:
                i = int(np.searchsorted(self.offsets, self.at + pos))
                if i < self.count and self.offsets[i] == self.at + pos:
                    found.append(i)
                pos = region.find(pattern, pos + 1)
        return sorted(set(found))


class _Metadata(dict):
    """A file's metadata: key -> value, a deferred array read from the mapped file when asked
    for (and then kept by this file object only)."""

    def __init__(self, items: dict, buf, size: int):
        super().__init__(items)
        self._buf, self._size = buf, size

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if isinstance(value, _Deferred):
            value = value.read(self._buf, self._size)
            self[key] = value
        return value

    def get(self, key, default=None):
        return self[key] if key in self else default  # noqa: SIM401 (reads a deferred one)

    def items(self):
        return ((k, self[k]) for k in self)

    def values(self):
        return (self[k] for k in self)


def _parse_header(buf, size: int) -> tuple[dict, list, int]:
    """(metadata with deferred long arrays, tensor infos, the header's end) of a mapped file;
    ValueError or struct.error on a malformed header."""
    cur = _Cursor(buf, size, defer=True)
    cur.at = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise ValueError(f"version {version} (this reader takes 2 and 3)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    metadata, infos = {}, []
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("<I"))
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("<I")
        if n_dims > 4:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        dims = tuple(cur.take("<Q") for _ in range(n_dims))
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    return metadata, infos, cur.at


class GGUFFile:
    """One opened GGUF file: ``metadata`` (key -> Python value), ``tensors`` (name ->
    ``Tensor``, data memory-mapped), ``arch`` and ``path``."""

    def __init__(self, path: str | os.PathLike, architectures: tuple[str, ...] = ARCHITECTURES):
        """Open ``path``, a file of one of ``architectures`` (a model's by default; an mmproj
        projector's is ``clip``)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path).expanduser()
        try:
            st = self.path.stat()
            size = st.st_size
            with self.path.open("rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot read ({e.strerror or e})") from None
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected "
                            f"{GGUF_MAGIC!r})")
        self._map = np.memmap(self.path, mode="c")
        buf = memoryview(self._map)
        key = (str(self.path.resolve()), size, st.st_mtime_ns)
        header = _HEADERS.get(key)
        if header is None:
            try:
                header = _parse_header(buf, size)
            except (ValueError, struct.error) as e:
                raise GGUFError(f"{self.path}: malformed or truncated GGUF header ({e})") \
                    from None
            _HEADERS[key] = header
            while len(_HEADERS) > _KEEP:
                _HEADERS.popitem(last=False)
        _HEADERS.move_to_end(key)
        metadata, infos, end = header
        self.metadata: dict[str, Any] = _Metadata(metadata, buf, size)
        self.arch = self.metadata.get("general.architecture")
        if self.arch not in architectures:
            kind = self.metadata.get("general.type")
            what = f"a {kind} file of" if kind and kind != "model" else "architecture"
            hint = " (a vision projector: give it as mmproj beside its model)" \
                if kind == "mmproj" else ""
            raise GGUFError(f"{self.path}: {what} {self.arch!r} is not one hybridrt loads "
                            f"here (it loads {', '.join(architectures)}){hint}")
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-end // align) * align
        self.tensors: dict[str, Tensor] = {}
        for name, dims, kind, offset in infos:
            try:
                qtype = GGMLQuantizationType(kind)
                block, block_bytes = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise GGUFError(f"{self.path}: tensor {name} has unknown type {kind}") from None
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            row = dims[0] if dims else 1
            if row % block:
                raise GGUFError(f"{self.path}: tensor {name}'s rows of {row} are not whole "
                                f"blocks of {block} ({qtype.name})")
            nbytes = n // block * block_bytes
            begin = start + offset
            if begin + nbytes > size:
                raise GGUFError(f"{self.path}: truncated: tensor {name} ends at byte "
                                f"{begin + nbytes}, the file has {size}")
            raw = self._map[begin:begin + nbytes]
            outer = tuple(reversed(dims[1:]))
            if qtype.name in ("F32", "F16"):
                data = raw.view(np.float32 if qtype.name == "F32" else np.float16).reshape(
                    *outer, row)
            else:
                data = raw.reshape(*outer, row // block * block_bytes)
            self.tensors[name] = Tensor(name, qtype, dims, data, begin, nbytes)

    def get(self, key: str, default: Any = None) -> Any:
        """``{arch}.key`` (a key without a dot in front: the architecture's) or a full key."""
        if key.startswith(("general.", "tokenizer.")):
            return self.metadata.get(key, default)
        return self.metadata.get(f"{self.arch}.{key}", default)

    def find_strings(self, key: str, texts) -> list[int]:
        """The indices of the items of string array ``key`` equal to one of ``texts``,
        ascending (without reading a long array whole)."""
        value = dict.get(self.metadata, key)
        if isinstance(value, _Deferred) and value.item == _STRING:
            return value.find(memoryview(self._map), texts)
        return [i for i, t in enumerate(self.get(key) or []) if t in texts]

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata {self.arch}.{key} is missing")
        return value

    @staticmethod
    def matrix(tensor: Tensor, i: int) -> Tensor:
        """Matrix ``i`` of a stacked 3-D tensor (one routed expert's) over the same pages."""
        n = tensor.n_bytes // tensor.shape[2]
        return Tensor(f"{tensor.name}[{i}]", tensor.tensor_type, tensor.shape[:2],
                      tensor.data[i], tensor.data_offset + i * n, n)

    @staticmethod
    def shape(tensor) -> tuple[int, ...]:
        """A tensor's shape in torch's order (GGUF writes the dimensions innermost first)."""
        return tuple(int(n) for n in reversed(tensor.shape))
