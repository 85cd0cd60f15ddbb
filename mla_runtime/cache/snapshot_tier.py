"""The lower tiers of prefix caching's state snapshots for a state that grows with its sequence (DeepSeek-V4's).

A V4 prefix hit resumes from a snapshot of the whole state at a block boundary (``cache/state_cache.SizedSnapshots``),
held in memory within ``state_snapshot_memory``. A snapshot that leaves that budget (evicted least recently used, or
its block hash left the block pool's index) is handed here instead of being lost, as the latent cache's blocks are
handed to ``cache/host_tier.py`` and ``cache/disk_tier.py``, under the same settings:

- **host RAM** (``SnapshotTier``, ``kv_cache_host_bytes``): the snapshot's tensors on the host, by block hash, least
  recently used first out; one that leaves goes to the disk tier when there is one, else it is dropped;
- **disk** (``SnapshotDisk``, ``kv_cache_dir``, bounded by ``kv_cache_disk_bytes``): one file per snapshot, written
  by a background thread (a step never waits for the disk), found again by a later engine on the same directory.

A snapshot here is model-neutral: named CPU tensors and the number of tokens it ends at (the model turns its state
into those and back, and checks the result against its config). Keys and validation follow the disk tier's: a file
is named by ``sha256(fingerprint ‖ block hash)``, the fingerprint covering the checkpoint's config and weights, the
dtype and the block size, so another model's or setting's snapshots are never looked up; the header repeats the
fingerprint and key, and a file whose size, header, checksum or tensors disagree is logged, deleted and read as a
miss (the prefix is then recomputed)::

    MAGIC (8 B) | header length (u32 LE) | header (JSON: version, fingerprint, key, tokens, tensors' names, dtypes
    and shapes) | the tensors' bytes in header order | crc32 of header + tensors (u32 LE) | END (8 B)

Files are written to a temporary name and renamed into place. Before a write the directory's snapshot files are kept
under ``kv_cache_disk_bytes`` (least recently used first: a read touches its file's mtime).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("mla_runtime")

FORMAT_VERSION = 1
MAGIC = b"MLASNAP1"
END = b"MLASNEND"
SUFFIX = ".snap"
LOW_WATERMARK = 0.9  # eviction frees the directory down to this fraction of its bound
DEFAULT_QUEUE_BYTES = 256 * 2**20
CLOSE_JOIN_S = 10.0
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}

Tensors = Mapping[str, torch.Tensor]  # a snapshot's named tensors, on the host


@dataclass(frozen=True)
class Snapshot:
    tensors: Tensors
    tokens: int  # the prefix it ends at

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class SnapshotTierStats:
    host_hits: int  # snapshots loaded back from host RAM
    disk_hits: int  # snapshots loaded back from files
    stored: int  # snapshots handed to the tiers
    host_evictions: int  # snapshots host RAM let go (to the disk tier, if any)
    files_written: int
    write_drops: int  # snapshots not written because the write queue was full
    corrupt_files: int  # files that did not validate: deleted, read as misses
    host_usage_bytes: int
    host_capacity_bytes: int
    disk_usage_bytes: int
    disk_capacity_bytes: int


class _Corrupt(Exception):
    pass


class SnapshotDisk:
    """Snapshot files under ``directory`` (see the module docstring), written in the background."""

    def __init__(self, directory: str | Path, fingerprint: str, capacity_bytes: int | None = None,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        self.root = Path(directory)
        self.folder = self.root / f"{fingerprint[:16]}-states"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fingerprint, self.queue_bytes = fingerprint, queue_bytes
        self._lock = threading.Condition()
        self._pending: dict[str, Snapshot] = {}  # key -> snapshot queued for writing (readable meanwhile)
        self._queued_bytes = 0
        self._usage = sum(size for _, size, _ in self._files())
        # as the latent disk tier's: by default what is there plus 90 % of the free space
        self.capacity_bytes = capacity_bytes if capacity_bytes is not None else (
            self._usage + int(LOW_WATERMARK * shutil.disk_usage(self.root).free))
        self.counts = dict.fromkeys(("hits", "files_written", "write_drops", "corrupt_files"), 0)
        self._writes: queue.Queue[str | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="mla-snapshot-writer", daemon=True)
        self._writer.start()
        self.closed = False

    def key(self, block_hash: int) -> str:
        return hashlib.sha256(self.fingerprint.encode() + block_hash.to_bytes(16, "little")).hexdigest()[:48]

    def path(self, key: str) -> Path:
        return self.folder / key[:2] / (key + SUFFIX)

    @property
    def usage_bytes(self) -> int:
        return self._usage

    def store(self, block_hash: int, snapshot: Snapshot, wait: bool = False) -> bool:
        """Queue ``snapshot`` for writing (a no-op when its file exists or is queued); a full queue drops it
        (counted) unless ``wait``. True when it is or will be on disk."""
        key = self.key(block_hash)
        with self._lock:
            if key in self._pending or self.path(key).is_file():
                return True
            n = snapshot.nbytes
            while self._queued_bytes and self._queued_bytes + n > self.queue_bytes and wait and not self.closed:
                self._lock.wait(0.1)
            if self.closed or (self._queued_bytes and self._queued_bytes + n > self.queue_bytes):
                self.counts["write_drops"] += 1
                return False
            self._pending[key] = snapshot
            self._queued_bytes += n
        self._writes.put(key)
        return True

    def tokens(self, block_hash: int) -> int | None:
        """The tokens of the snapshot kept for ``block_hash`` (its header's), None when there is none readable."""
        key = self.key(block_hash)
        with self._lock:
            queued = self._pending.get(key)
        if queued is not None:
            return queued.tokens
        try:
            with open(self.path(key), "rb") as f:
                head = f.read(12)
                if len(head) != 12 or head[:8] != MAGIC:
                    return None
                (n,) = struct.unpack("<I", head[8:])
                meta = json.loads(f.read(min(n, 1 << 20)))
            tokens = meta.get("tokens") if isinstance(meta, dict) else None
            return tokens if isinstance(tokens, int) and tokens > 0 else None  # a bad one: no room is reserved
        except (OSError, ValueError):
            return None

    def load(self, block_hash: int) -> Snapshot | None:
        """The validated snapshot of ``block_hash`` (a corrupt or foreign file is logged, deleted and read as None)."""
        key = self.key(block_hash)
        with self._lock:
            queued = self._pending.get(key)
        if queued is not None:
            self.counts["hits"] += 1
            return queued
        path = self.path(key)
        try:
            buf = path.read_bytes()
        except OSError:
            return None
        try:
            snapshot = self._parse(key, buf)
        except _Corrupt as e:
            self.reject(block_hash, str(e))
            return None
        try:
            os.utime(path)  # least recently used goes first
        except OSError:
            pass
        self.counts["hits"] += 1
        return snapshot

    def reject(self, block_hash: int, why: str) -> None:
        """``block_hash``'s file does not hold a snapshot this model can take: log it, delete it, count it."""
        path = self.path(self.key(block_hash))
        logger.warning("state snapshot tier: %s is not a valid snapshot for this model (%s); deleted, the prefix is "
                       "recomputed", path.name, why)
        with self._lock:
            self.counts["corrupt_files"] += 1
        _unlink(str(path))

    def flush(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(0.5 if left is None else min(left, 0.5))
        return True

    def close(self, timeout: float | None = None) -> None:
        if self.closed:
            return
        if not self.flush(timeout):
            logger.warning("state snapshot tier: %d snapshots were not written within the shutdown timeout",
                           len(self._pending))
        self.closed = True
        self._writes.put(None)
        if self._writer.is_alive() and self._writer is not threading.current_thread():
            self._writer.join(CLOSE_JOIN_S)

    # -- files -----------------------------------------------------------------------------------
    def _header(self, key: str, snapshot: Snapshot) -> bytes:
        tensors = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in snapshot.tensors.items()]
        meta = {"version": FORMAT_VERSION, "fingerprint": self.fingerprint, "key": key, "tokens": snapshot.tokens,
                "tensors": tensors}
        body = json.dumps(meta, sort_keys=True).encode()
        return MAGIC + struct.pack("<I", len(body)) + body

    def _parse(self, key: str, buf: bytes) -> Snapshot:
        if len(buf) < 12 + 4 + len(END) or buf[:8] != MAGIC:
            raise _Corrupt("bad magic or truncated")
        (n,) = struct.unpack("<I", buf[8:12])
        try:
            meta = json.loads(buf[12:12 + n])
        except ValueError as e:
            raise _Corrupt(f"unreadable header: {e}") from None
        if not isinstance(meta, dict) or meta.get("version") != FORMAT_VERSION or meta.get("key") != key \
                or meta.get("fingerprint") != self.fingerprint or not isinstance(meta.get("tokens"), int):
            raise _Corrupt("header differs (another model, setting or format)")
        specs = _specs(meta.get("tensors"))
        end = 12 + n + sum(_numel(shape) * DTYPES[dtype].itemsize for _, dtype, shape in specs)
        if len(buf) != end + 4 + len(END):
            raise _Corrupt(f"{len(buf)} bytes, expected {end + 4 + len(END)}")
        (crc,) = struct.unpack("<I", buf[end:end + 4])
        if crc != zlib.crc32(memoryview(buf)[:end]) or buf[end + 4:] != END:
            raise _Corrupt("checksum mismatch")
        data, offset, tensors = bytearray(buf[12 + n:end]), 0, {}
        for name, dtype, shape in specs:
            count = _numel(shape)
            t = torch.frombuffer(data, dtype=DTYPES[dtype], offset=offset, count=count) if count else \
                torch.empty(0, dtype=DTYPES[dtype])
            tensors[name] = t.view(shape)
            offset += count * DTYPES[dtype].itemsize
        return Snapshot(tensors, int(meta["tokens"]))

    def _write_file(self, key: str, snapshot: Snapshot) -> None:
        path = self.path(key)
        if path.is_file():
            return
        head = self._header(key, snapshot)
        bodies = [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in snapshot.tensors.values()]
        crc = zlib.crc32(head)
        for b in bodies:
            crc = zlib.crc32(b, crc)
        size = len(head) + sum(map(len, bodies)) + 4 + len(END)
        self._make_room(size)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(head)
            for b in bodies:
                f.write(b)
            f.write(struct.pack("<I", crc) + END)
        os.replace(tmp, path)
        with self._lock:
            self._usage += size
            self.counts["files_written"] += 1

    def _write_loop(self) -> None:
        while (key := self._writes.get()) is not None:
            with self._lock:
                snapshot = self._pending[key]
            try:
                self._write_file(key, snapshot)
            except OSError as e:
                logger.warning("state snapshot tier: cannot write %s: %s", key, e)
            with self._lock:
                del self._pending[key]
                self._queued_bytes -= snapshot.nbytes
                self._lock.notify_all()

    def _files(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every snapshot file under the root (every model's)."""
        found: list[tuple[float, int, str]] = []
        for folder, _, names in os.walk(self.root):
            for name in names:
                if name.endswith(SUFFIX):
                    try:
                        st = os.stat(os.path.join(folder, name))
                    except OSError:
                        continue
                    found.append((st.st_mtime, st.st_size, os.path.join(folder, name)))
        return found

    def _make_room(self, incoming: int) -> None:
        """Keep the snapshot files under ``capacity_bytes``: least recently used ones go down to the low watermark."""
        if self._usage + incoming <= self.capacity_bytes:
            return
        files = self._files()
        usage = sum(size for _, size, _ in files)
        target = int(self.capacity_bytes * LOW_WATERMARK) - incoming
        for _, size, path in sorted(files):
            if usage <= target:
                break
            if _unlink(path):
                usage -= size
        with self._lock:
            self._usage = usage


class SnapshotTier:
    """Snapshots in host RAM within ``capacity_bytes`` (0: none kept there) over an optional ``disk`` tier; a
    snapshot host RAM lets go (least recently used first, or one larger than all of it) goes to the disk tier."""

    def __init__(self, capacity_bytes: int, disk: SnapshotDisk | None = None) -> None:
        self.capacity_bytes, self.disk = capacity_bytes, disk
        self._lru: OrderedDict[int, Snapshot] = OrderedDict()  # block hash -> snapshot, least recently used first
        self.usage_bytes = 0
        self.counts = dict.fromkeys(("host_hits", "stored", "host_evictions"), 0)
        self.closed = False

    def store(self, block_hash: int, snapshot: Snapshot, persist: bool = False) -> None:
        """Keep ``snapshot`` (its tensors on the host, never written into afterwards); ``persist``: write it to the
        disk tier alone (write-through of a snapshot that stays in memory)."""
        if self.closed:
            return
        self.counts["stored"] += 1
        if persist:  # write-through: the snapshot stays in memory, and goes to disk at once
            if self.disk is not None:
                self.disk.store(block_hash, snapshot)
            return
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return
        if snapshot.nbytes > self.capacity_bytes:
            if self.disk is not None:
                self.disk.store(block_hash, snapshot)
            return
        while self.usage_bytes + snapshot.nbytes > self.capacity_bytes:
            h, old = self._lru.popitem(last=False)
            self.usage_bytes -= old.nbytes
            self.counts["host_evictions"] += 1
            if self.disk is not None:
                self.disk.store(h, old)
        self._lru[block_hash] = snapshot
        self.usage_bytes += snapshot.nbytes

    def tokens(self, block_hash: int) -> int | None:
        """The tokens of the snapshot kept for ``block_hash`` here or on disk (None: none)."""
        held = self._lru.get(block_hash)
        if held is not None:
            return held.tokens
        return None if self.disk is None or self.closed else self.disk.tokens(block_hash)

    def load(self, block_hash: int) -> Snapshot | None:
        """The snapshot of ``block_hash`` (host RAM first, then disk; it stays where it was: a copy)."""
        held = self._lru.get(block_hash)
        if held is not None:
            self._lru.move_to_end(block_hash)
            self.counts["host_hits"] += 1
            return held
        return None if self.disk is None or self.closed else self.disk.load(block_hash)

    def reject(self, block_hash: int, why: str) -> None:
        """A snapshot loaded for ``block_hash`` does not fit the model: forget it wherever it is kept."""
        held = self._lru.pop(block_hash, None)
        if held is not None:
            self.usage_bytes -= held.nbytes
            logger.warning("state snapshot tier: a snapshot in host RAM does not fit the model (%s); dropped", why)
        elif self.disk is not None:
            self.disk.reject(block_hash, why)

    def close(self, resident: Sequence[tuple[int, Snapshot]] = (), timeout: float | None = None) -> int:
        """Write ``resident`` (the snapshots still in memory) and host RAM's to the disk tier, waiting for queue room,
        then the queue within ``timeout`` s; returns how many were handed to it. Without a disk tier, only closes."""
        if self.closed:
            return 0
        self.closed = True
        handed = 0
        if self.disk is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            for h, snapshot in [*resident, *reversed(self._lru.items())]:
                if deadline is not None and time.monotonic() > deadline:
                    break
                handed += int(self.disk.store(h, snapshot, wait=True))
            self.disk.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._lru.clear()
        self.usage_bytes = 0
        return handed

    def stats(self) -> SnapshotTierStats:
        d = self.disk
        disk = d.counts if d is not None else dict.fromkeys(("hits", "files_written", "write_drops",
                                                              "corrupt_files"), 0)
        return SnapshotTierStats(host_hits=self.counts["host_hits"], disk_hits=disk["hits"],
                                 stored=self.counts["stored"], host_evictions=self.counts["host_evictions"],
                                 files_written=disk["files_written"], write_drops=disk["write_drops"],
                                 corrupt_files=disk["corrupt_files"], host_usage_bytes=self.usage_bytes,
                                 host_capacity_bytes=self.capacity_bytes,
                                 disk_usage_bytes=d.usage_bytes if d is not None else 0,
                                 disk_capacity_bytes=d.capacity_bytes if d is not None else 0)


def _specs(raw: object) -> list[tuple[str, str, list[int]]]:
    """The header's tensors as ``(name, dtype, shape)``, checked."""
    if not isinstance(raw, list):
        raise _Corrupt("header lists no tensors")
    out = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and item[1] in DTYPES
                and isinstance(item[2], list) and all(isinstance(d, int) and d >= 0 for d in item[2])):
            raise _Corrupt(f"bad tensor entry {item!r:.80}")
        out.append((item[0], item[1], list(item[2])))
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
