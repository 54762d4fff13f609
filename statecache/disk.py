"""The prefix cache's disk tier: KV blocks and GDN checkpoints in a directory that outlives the
engine (``LLM(prefix_cache_dir=...)``, ``--prefix-cache-dir``).

| file | holds | named by |
| --- | --- | --- |
| ``blocks/<hex>`` | a full block's KV (every attention layer, the MTP's too) | its chain hash |
| ``ckpts/<hex>`` | a checkpoint: conv + recurrent state, KV tail, MTP hidden | its index key |

Every name is ``blake2b(identity, format version, kind, key)``; the identity is the cache's
salt (model path, dtype, quantization, block size) and the geometry of its tensors, so another
model's or format's file is never looked up. Each file is ``MAGIC``, a 4-byte header length,
a JSON header (identity, format, the payload's length and blake2b digest; a checkpoint's
index key, length and tail) and the payload (``torch.save`` of its tensors, read back with
``weights_only``). Files are written to a temporary name and renamed (a reader never sees half
a file); one whose header names another identity, or whose payload is short or fails its
digest, is skipped with a log line (and a bad one deleted), never trusted.

The directory is bounded (``max_bytes``): least recently used files go first. Started on a
directory, the tier indexes what is there (the headers only).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import struct
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"HRTPFX\x00\x01"
FORMAT_VERSION = 1
log = logging.getLogger("hybridrt.prefix_disk")


@dataclass(slots=True, frozen=True)
class DiskCheckpoint:
    """What the index knows of a checkpoint file (from its header)."""

    name: str
    anchor: bytes
    tail: tuple[int, ...]
    num_tokens: int
    num_shared: int


class DiskTier:
    """The files of one cache identity in ``directory``: the block names, the checkpoints by
    anchor, the LRU order and the bytes they take."""

    def __init__(self, directory: str | os.PathLike, identity: str, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"prefix cache directory size must be positive, got {max_bytes}")
        self.dir = Path(directory)
        for sub in ("blocks", "ckpts"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.identity = identity
        self.max_bytes = max_bytes
        self._prefix = hashlib.blake2b(f"{identity}|v{FORMAT_VERSION}".encode(),
                                       digest_size=16).digest()
        self._lru: OrderedDict[str, int] = OrderedDict()  # name -> bytes, least recent first
        self.blocks: set[str] = set()
        self.checkpoints: dict[str, DiskCheckpoint] = {}
        self.by_anchor: dict[bytes, list[DiskCheckpoint]] = {}
        self.bytes = 0
        self.stats = {"disk_block_writes": 0, "disk_checkpoint_writes": 0,
                      "disk_block_restores": 0, "disk_checkpoint_restores": 0,
                      "disk_evictions": 0, "disk_bad_files": 0}
        self._scan()

    # Names -------------------------------------------------------------------------------
    def _name(self, kind: str, key: bytes) -> str:
        sub = "blocks" if kind == "b" else "ckpts"
        return f"{sub}/{hashlib.blake2b(self._prefix + kind.encode() + key).hexdigest()}"

    def block_name(self, h: bytes) -> str:
        return self._name("b", h)

    def checkpoint_name(self, key: tuple[bytes, tuple[int, ...]]) -> str:
        return self._name("c", key[0] + array("q", key[1]).tobytes())

    def has_block(self, h: bytes) -> bool:
        return self.block_name(h) in self.blocks

    # Reading -----------------------------------------------------------------------------
    def _read_header(self, f) -> dict | None:
        if f.read(len(MAGIC)) != MAGIC:
            return None
        raw = f.read(4)
        if len(raw) != 4:
            return None
        (n,) = struct.unpack("<I", raw)
        try:
            return json.loads(f.read(n))
        except ValueError:
            return None

    def _scan(self) -> None:
        found = []
        for sub in ("blocks", "ckpts"):
            for path in (self.dir / sub).iterdir():
                if path.name.endswith(".tmp") or not path.is_file():
                    continue
                name = f"{sub}/{path.name}"
                try:
                    with open(path, "rb") as f:
                        header = self._read_header(f)
                    st = path.stat()
                except OSError:
                    continue
                if header is None or header.get("name") != name:
                    self._bad(name, "no valid header")
                    continue
                if header.get("identity") != self.identity or (
                        header.get("format") != FORMAT_VERSION):
                    log.warning("prefix cache: %s is another model's or format's file "
                                "(identity %r): not used", path, header.get("identity"))
                    continue
                found.append((st.st_mtime, name, st.st_size, header))
        for _, name, size, header in sorted(found, key=lambda x: x[0]):
            self._index(name, size, header)
        self._shrink()

    def _index(self, name: str, size: int, header: dict) -> None:
        if name in self._lru:
            self._forget(name)
        self._lru[name] = size
        self.bytes += size
        if name.startswith("blocks/"):
            self.blocks.add(name)
        else:
            ck = DiskCheckpoint(name, bytes.fromhex(header["anchor"]), tuple(header["tail"]),
                                header["num_tokens"], header["num_shared"])
            self.checkpoints[name] = ck
            self.by_anchor.setdefault(ck.anchor, []).append(ck)

    def get(self, name: str) -> dict[str, torch.Tensor] | None:
        """The tensors of file ``name``, verified (its header's identity, the payload's length
        and digest) -> them, or None (a bad file is logged and deleted)."""
        if name not in self._lru:
            return None
        try:
            with open(self.dir / name, "rb") as f:
                header = self._read_header(f)
                payload = f.read()
        except OSError as e:
            self._bad(name, f"unreadable ({e})")
            return None
        if header is None or header.get("identity") != self.identity or (
                header.get("format") != FORMAT_VERSION or header.get("name") != name):
            self._bad(name, "its header does not match this cache")
            return None
        if len(payload) != header.get("size"):
            self._bad(name, f"truncated ({len(payload)} of {header.get('size')} payload bytes)")
            return None
        if hashlib.blake2b(payload).hexdigest() != header.get("blake2b"):
            self._bad(name, "its payload fails its checksum")
            return None
        try:
            tensors = torch.load(io.BytesIO(payload), weights_only=True)
        except Exception as e:  # a payload that passed its digest but does not load
            self._bad(name, f"does not load ({e})")
            return None
        self._lru.move_to_end(name)
        return tensors

    def _bad(self, name: str, why: str) -> None:
        log.warning("prefix cache: skipped %s: %s", self.dir / name, why)
        self.stats["disk_bad_files"] += 1
        self._delete(name)

    # Writing -----------------------------------------------------------------------------
    def put(self, name: str, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> None:
        """Write a file atomically (a temporary name, then a rename); the least recently used
        files go while the directory is over its size."""
        buf = io.BytesIO()
        torch.save({k: v.detach().to("cpu").clone() for k, v in tensors.items()}, buf)
        payload = buf.getvalue()
        header = {"identity": self.identity, "format": FORMAT_VERSION, "name": name,
                  "size": len(payload), "blake2b": hashlib.blake2b(payload).hexdigest(),
                  **(meta or {})}
        head = json.dumps(header).encode()
        path = self.dir / name
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(head)) + head + payload)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("prefix cache: could not write %s: %s", path, e)
            tmp.unlink(missing_ok=True)
            return
        self._index(name, len(MAGIC) + 4 + len(head) + len(payload), header)
        self.stats["disk_block_writes" if name.startswith("blocks/")
                   else "disk_checkpoint_writes"] += 1
        self._shrink()

    def put_checkpoint(self, key: tuple[bytes, tuple[int, ...]], num_tokens: int,
                       num_shared: int, tensors: dict[str, torch.Tensor]) -> None:
        name = self.checkpoint_name(key)
        if name not in self.checkpoints:
            self.put(name, tensors, {"anchor": key[0].hex(), "tail": list(key[1]),
                                     "num_tokens": num_tokens, "num_shared": num_shared})

    def _forget(self, name: str) -> None:
        size = self._lru.pop(name, None)
        if size is None:
            return
        self.bytes -= size
        self.blocks.discard(name)
        ck = self.checkpoints.pop(name, None)
        if ck is not None:
            same = self.by_anchor[ck.anchor]
            same.remove(ck)
            if not same:
                del self.by_anchor[ck.anchor]

    def _shrink(self) -> None:
        while self.bytes > self.max_bytes and self._lru:
            self._delete(next(iter(self._lru)))
            self.stats["disk_evictions"] += 1

    def clear(self) -> None:
        """Delete every file of this identity."""
        for name in list(self._lru):
            self._delete(name)

    def _delete(self, name: str) -> None:
        self._forget(name)
        with contextlib.suppress(OSError):
            os.unlink(self.dir / name)
