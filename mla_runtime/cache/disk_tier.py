"""The disk tier of the latent prefix cache: full cache blocks as files that outlive the process.

A block leaves the device pool (evicted, or at once with write-through) by ``store``: its rows of every layer
(and their scales) are copied into one host buffer on the caller's thread — so the device block may be reused
as soon as ``store`` returns — and a background thread writes the buffer to disk. A prefix miss in the device
pool asks ``lookup`` how many of the next blocks are on disk and ``load``s them into fresh blocks.

Keys. A block's file is named by ``sha256(fingerprint ‖ block hash)``: the block hash chains over every token
of the prefix (``engine/block_pool.py``), and the fingerprint (``model_fingerprint``) over everything that
decides the latent's bytes — the checkpoint's config and weights identity, the latent rank and projection,
the weight and cache dtypes, the block size and the tensor-parallel layout. A cache written under any other
setting has other names, so it is never read; the header repeats the fingerprint and the key, and a file
whose header disagrees is treated as corrupt.

File (``<dir>/<fingerprint[:16]>/<key[:2]>/<key>[.r<rank>].blk``; ``.r<rank>``: one shard of the sharded
tensor-parallel layout)::

    MAGIC (8 B) | header length (u32 LE) | header (JSON) | payload | crc32 of header + payload (u32 LE) | END (8 B)
    payload = for each layer: latent rows [block_tokens, d_c + d_r] (cache dtype); then, for fp8/int8 caches,
              for each layer: scales [block_tokens, 2] (fp32)

so the payload is exactly the latent cache's bytes per token times the block's tokens. A file is written to a
temporary name in its folder and renamed into place (atomic on POSIX), so a reader never sees a partial file
and several processes can share a directory; a truncated or corrupt file (bad size, magic, header or
checksum) is deleted, counted, and read as a miss. ``disk_bytes`` bounds the whole directory: before a write
the writer rescans it (at most every ``RESCAN_SECONDS``, and whenever its own count says it is full) and
deletes the least recently used files — a read touches its file's mtime — down to 90 % of the bound.

Prefetch: ``prefetch(hashes)`` reads the files of a queued request in a second background thread into a
bounded staging area, so that its ``load`` is a memory copy.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.parallel import ParallelContext

logger = logging.getLogger("mla_runtime")

FORMAT_VERSION = 1
MAGIC = b"MLAKVBLK"
END = b"MLAKVEND"
HEADER_ESTIMATE_BYTES = 320  # magic, header JSON, checksum and end marker of one file (about 280 B; for the planner)
RESCAN_SECONDS = 2.0
TEMP_FILE_MAX_AGE = 600.0  # s: older temporary files are a crashed writer's leftovers
LOW_WATERMARK = 0.9  # eviction frees the directory down to this fraction of its bound
DEFAULT_QUEUE_BYTES = 256 * 2**20
DEFAULT_STAGING_BYTES = 256 * 2**20
CLOSE_JOIN_S = 10.0  # close() waits this long for each thread to take its stop signal (past a write in flight)


# -- keys --------------------------------------------------------------------------------------------
def weights_identity(model_path: str | Path) -> list[dict[str, object]]:
    """A cheap identity of each ``*.safetensors`` file: its size and the sha256 of its header (tensor names, dtypes,
    shapes, offsets), plus the content's sha256 when the file is a hub-cache blob (named by it), else its mtime."""
    out: list[dict[str, object]] = []
    for f in sorted(Path(model_path).glob("*.safetensors")):
        real = f.resolve()
        st = real.stat()
        entry: dict[str, object] = {"name": f.name, "size": st.st_size}
        if len(real.name) == 64 and all(c in "0123456789abcdef" for c in real.name):
            entry["sha256"] = real.name
        else:
            entry["mtime_ns"] = st.st_mtime_ns
        with open(real, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            entry["header_sha256"] = hashlib.sha256(fh.read(min(n, 100 * 2**20))).hexdigest()
        out.append(entry)
    return out


def model_fingerprint(model_path: str | Path, settings: Mapping[str, object]) -> str:
    """sha256 (hex) of the checkpoint's ``config.json``, its weights' identity and ``settings`` (everything else
    that decides the cached bytes: latent rank and projection, dtypes, block size, tensor-parallel layout)."""
    h = hashlib.sha256(f"mla-runtime latent cache v{FORMAT_VERSION}\n".encode())
    config = Path(model_path) / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    h.update(json.dumps(weights_identity(model_path), sort_keys=True).encode())
    h.update(json.dumps(dict(settings), sort_keys=True, default=str).encode())
    return h.hexdigest()


def file_sha256(path: str | Path | None) -> str | None:
    if not path:
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# -- statistics --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiskTierStats:
    bytes_read: int  # file bytes read (loads and prefetches)
    bytes_written: int  # file bytes written by this process
    blocks_written: int
    write_queue_depth: int  # blocks copied out, waiting for the writer
    write_drops: int  # blocks not written because the queue was full (a step never waits for the disk)
    evictions: int  # files this process deleted to keep the directory under its bound
    corrupt_files: int  # truncated, corrupt or foreign files found, deleted and read as misses
    usage_bytes: int  # the directory's size at the last scan plus this process's writes since
    capacity_bytes: int


@dataclass
class _Write:
    key: str
    path: Path
    payload: torch.Tensor  # uint8 on the host


class _Corrupt(Exception):
    pass


class DiskTier:
    """Files of one rank's latent-cache blocks under ``directory`` (see the module docstring). ``shard``: this rank's
    index under the sharded tensor-parallel layout (None: the whole block). ``block_size``: tokens per block."""

    persistent = True  # what it holds outlives the process (a shutdown stores the resident blocks here)

    def __init__(self, directory: str | Path, fingerprint: str, cache: LatentCache, block_size: int,
                 capacity_bytes: int | None = None, shard: int | None = None,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        started = time.monotonic()
        self.root = Path(directory)
        self.folder = self.root / fingerprint[:16]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.cache = cache
        self.block_size = block_size
        self.shard = shard
        self.suffix = f".r{shard}.blk" if shard is not None else ".blk"
        self.payload_bytes = cache.block_bytes()
        self.queue_bytes = queue_bytes
        self.staging_bytes = staging_bytes
        self._lock = threading.Condition()
        self._present: set[str] = set()  # keys known to be on disk
        self._pending: set[str] = set()  # keys copied out, not yet written
        self._queued_bytes = 0
        self._staged: OrderedDict[str, torch.Tensor] = OrderedDict()  # prefetched payloads
        self._staged_bytes = 0
        self._reading: str | None = None
        self._wanted: set[str] = set()  # keys asked for by prefetch and not loaded yet
        self._counts = dict.fromkeys(("bytes_read", "bytes_written", "blocks_written", "write_drops", "evictions",
                                      "corrupt_files"), 0)
        logger.info("disk tier: reading the usage of %s", self.root)
        self._usage, self._last_scan = self._scan_usage(), time.monotonic()
        logger.info("disk tier: %.1f MiB of blocks in %s, read in %.1f s", self._usage / 2**20, self.root,
                    self._last_scan - started)
        self.capacity_bytes = capacity_bytes if capacity_bytes is not None else (
            self._usage + int(LOW_WATERMARK * shutil.disk_usage(self.root).free))
        self._writes: queue.Queue[_Write | None] = queue.Queue()
        self._reads: queue.Queue[str | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="mla-kv-disk-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="mla-kv-disk-prefetch", daemon=True)
        self._writer.start()
        self._reader.start()
        self.closed = False

    # -- names -----------------------------------------------------------------------------------
    def key(self, block_hash: int) -> str:
        return hashlib.sha256(self.fingerprint.encode() + block_hash.to_bytes(16, "little")).hexdigest()[:48]

    def path(self, key: str) -> Path:
        return self.folder / key[:2] / (key + self.suffix)

    def file_bytes(self) -> int:
        """Bytes of one block's file (the payload plus its header and markers; the header's size varies little)."""
        return len(self._header(self.key(0))) + self.payload_bytes + 4 + len(END)

    def capacity_tokens(self) -> int:
        return self.capacity_bytes // self.file_bytes() * self.block_size

    # -- the pool's side -------------------------------------------------------------------------
    def store(self, block_hash: int, block: int, wait: bool = False) -> bool:
        """Copy ``block``'s rows out now and queue them for writing (a no-op when the file exists or is queued).
        A full queue drops the block (counted) unless ``wait``. True when the block is or will be on disk."""
        return self.store_payload(block_hash, lambda: self._snapshot(block), wait)

    def store_payload(self, block_hash: int, payload: torch.Tensor | Callable[[], torch.Tensor],
                      wait: bool = False) -> bool:
        """``store`` for a block already out of the cache: ``payload`` is its bytes on the host (laid out as
        ``LatentCache.read_block`` makes them; the writer keeps the tensor, so it must not change afterwards), or a
        function that returns them, called only when the block is to be written."""
        key = self.key(block_hash)
        with self._lock:
            if key in self._present or key in self._pending:
                return True
            n = self.payload_bytes
            while self._queued_bytes + n > self.queue_bytes and self._queued_bytes and wait and not self.closed:
                self._lock.wait(0.1)
            if self._queued_bytes + n > self.queue_bytes and self._queued_bytes or self.closed:
                self._counts["write_drops"] += 1
                return False
            self._pending.add(key)
            self._queued_bytes += n
        self._writes.put(_Write(key, self.path(key), payload() if callable(payload) else payload))
        return True

    def lookup(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` have a file (or a prefetched copy)."""
        n = 0
        for h in hashes:
            key = self.key(h)
            if key not in self._staged and not self.path(key).is_file():
                break
            n += 1
        return n

    def load(self, hashes: Sequence[int], blocks: Sequence[int]) -> int:
        """Fill ``blocks`` with the files of ``hashes`` in order; stops at the first missing or corrupt one (a
        corrupt file is deleted and counted). Returns how many were loaded."""
        for i, (h, b) in enumerate(zip(hashes, blocks)):
            key = self.key(h)
            payload = self._take_staged(key)
            if payload is None:
                payload = self._read(key)
            if payload is None:
                return i
            self._fill(b, payload)
            with self._lock:
                self._present.add(key)
            try:
                os.utime(self.path(key))  # least recently used goes first
            except OSError:
                pass
        return len(blocks)

    def prefetch(self, hashes: Sequence[int]) -> None:
        """Read the files of ``hashes`` in the background, up to the staging bound (newest kept)."""
        for h in hashes:
            key = self.key(h)
            with self._lock:
                self._wanted.add(key)
            self._reads.put(key)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (True), or ``timeout`` seconds pass (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left if left is not None else 0.5)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued (up to ``timeout`` s), then stop the threads and wait for them (a thread still inside
        a torch call when the interpreter exits can abort the process)."""
        if self.closed:
            return
        done = self.flush(timeout)
        if not done:
            logger.warning("disk tier: %d blocks were not written within the shutdown timeout", len(self._pending))
        self.closed = True
        self._writes.put(None)
        self._reads.put(None)
        for thread in (self._writer, self._reader):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(CLOSE_JOIN_S)

    def stats(self) -> DiskTierStats:
        with self._lock:
            c = dict(self._counts)
            return DiskTierStats(write_queue_depth=len(self._pending), usage_bytes=self._usage,
                                 capacity_bytes=self.capacity_bytes, **c)

    # -- tensors ---------------------------------------------------------------------------------
    def _snapshot(self, block: int) -> torch.Tensor:
        """``block``'s bytes in every layer (latents, then scales) as one host uint8 tensor (a copy)."""
        return self.cache.read_block(block).cpu()

    def _fill(self, block: int, payload: torch.Tensor) -> None:
        self.cache.write_block(block, payload)

    # -- files -----------------------------------------------------------------------------------
    def _header(self, key: str) -> bytes:
        c = self.cache
        meta = {"version": FORMAT_VERSION, "fingerprint": self.fingerprint, "key": key, "shard": self.shard,
                "layers": len(c.layers), "block_tokens": c.block_size, "dim": c.latent_dim,
                "dtype": str(c.dtype).removeprefix("torch."), "scales": c.quantised}
        body = json.dumps(meta, sort_keys=True).encode()
        return MAGIC + struct.pack("<I", len(body)) + body

    def _read(self, key: str) -> torch.Tensor | None:
        """The validated payload of ``key``'s file, or None (missing; or corrupt: then deleted and counted)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buf = bytearray(size)
                got = f.readinto(buf)
        except OSError:
            return None
        with self._lock:
            self._counts["bytes_read"] += got
        try:
            return self._parse(key, buf, got)
        except _Corrupt as e:
            self._discard(path, str(e))
            return None

    def _parse(self, key: str, buf: bytearray, size: int) -> torch.Tensor:
        head = self._header(key)
        want = len(head) + self.payload_bytes + 4 + len(END)
        if size != want or len(buf) != want:
            raise _Corrupt(f"{size} bytes, expected {want}")
        if bytes(buf[:len(head)]) != head:
            raise _Corrupt("header differs (another model, setting or format)")
        end = len(head) + self.payload_bytes
        view = memoryview(buf)
        (crc,) = struct.unpack("<I", view[end:end + 4])
        if crc != zlib.crc32(view[:end]) or bytes(view[end + 4:]) != END:
            raise _Corrupt("checksum mismatch")
        return torch.frombuffer(buf, dtype=torch.uint8, offset=len(head), count=self.payload_bytes)

    def _discard(self, path: Path, why: str) -> None:
        logger.warning("disk tier: %s is corrupt (%s); deleted", path.name, why)
        with self._lock:
            self._counts["corrupt_files"] += 1
        try:
            path.unlink()
        except OSError:
            pass

    def _write_file(self, w: _Write) -> None:
        head = self._header(w.key)
        body = w.payload.numpy()
        crc = zlib.crc32(body.data, zlib.crc32(head))
        size = len(head) + body.nbytes + 4 + len(END)
        if w.path.is_file():  # another process (or an earlier run) wrote it
            return
        self._make_room(size)
        w.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = w.path.with_name(f".{w.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(body.data)
            f.write(struct.pack("<I", crc) + END)
        os.replace(tmp, w.path)
        with self._lock:
            self._usage += size
            self._counts["bytes_written"] += size
            self._counts["blocks_written"] += 1

    def _write_loop(self) -> None:
        while (w := self._writes.get()) is not None:
            try:
                self._write_file(w)
                ok = True
            except OSError as e:
                logger.warning("disk tier: cannot write %s: %s", w.path, e)
                ok = False
            with self._lock:
                self._pending.discard(w.key)
                if ok:
                    self._present.add(w.key)
                self._queued_bytes -= w.payload.numel()
                self._lock.notify_all()

    def _read_loop(self) -> None:
        while (key := self._reads.get()) is not None:
            with self._lock:
                if key in self._staged or key not in self._wanted:
                    continue
                self._reading = key
            payload = self._read(key)
            with self._lock:
                self._reading = None
                if payload is None:
                    self._wanted.discard(key)
                elif key in self._wanted:
                    self._staged[key] = payload
                    self._staged_bytes += payload.numel()
                    while self._staged_bytes > self.staging_bytes:
                        old_key, old = self._staged.popitem(last=False)
                        self._staged_bytes -= old.numel()
                        self._wanted.discard(old_key)
                self._lock.notify_all()

    def _take_staged(self, key: str) -> torch.Tensor | None:
        with self._lock:
            while self._reading == key:  # the prefetch thread is reading it: take its copy
                self._lock.wait(0.1)
            self._wanted.discard(key)
            payload = self._staged.pop(key, None)
            if payload is not None:
                self._staged_bytes -= payload.numel()
            return payload

    # -- the directory's bound -------------------------------------------------------------------
    def _files(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every block file under the root (all models); stale temporary files go."""
        found: list[tuple[float, int, str]] = []
        now = time.time()
        stack = [str(self.root)]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except OSError:
                continue
            for e in entries:
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                        continue
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if e.name.endswith(".blk"):
                    found.append((st.st_mtime, st.st_size, e.path))
                elif e.name.endswith(".tmp") and now - st.st_mtime > TEMP_FILE_MAX_AGE:
                    _unlink(e.path)
        return found

    def _scan_usage(self) -> int:
        return sum(size for _, size, _ in self._files())

    def _make_room(self, incoming: int) -> None:
        """Keep the directory under ``capacity_bytes``: rescan it when the last scan is old or the count says full,
        then delete the least recently used files down to the low watermark."""
        stale = time.monotonic() - self._last_scan > RESCAN_SECONDS
        if not stale and self._usage + incoming <= self.capacity_bytes:
            return
        files = self._files()
        usage = sum(size for _, size, _ in files)
        self._last_scan = time.monotonic()
        evicted: list[str] = []
        if usage + incoming > self.capacity_bytes:
            target = int(self.capacity_bytes * LOW_WATERMARK) - incoming
            for _, size, path in sorted(files):
                if usage <= target:
                    break
                if _unlink(path):
                    usage -= size
                    evicted.append(Path(path).name.split(".")[0])
        with self._lock:
            self._usage = usage
            self._counts["evictions"] += len(evicted)
            self._present.difference_update(evicted)


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


# -- tensor parallelism --------------------------------------------------------------------------
def broadcast_blocks(cache: LatentCache, blocks: Sequence[int], par: ParallelContext) -> None:
    """Rank 0's rows of ``blocks`` (every layer, scales and indexer keys too) into every rank's cache (replicated
    layout)."""
    idx = torch.tensor(list(blocks), dtype=torch.long, device=cache.layers[0].kv.device)
    for layer in cache.layers:
        for t in (layer.kv, layer.scales, layer.index, layer.index_scales):
            if t is None:
                continue
            rows = t.index_select(0, idx).contiguous()
            dist.broadcast(rows.view(torch.uint8), src=0)
            if par.rank != 0:
                t.index_copy_(0, idx, rows)


def agree_min(n: int, par: ParallelContext) -> int:
    """The smallest ``n`` over all ranks (how many blocks every rank's shard loaded)."""
    if not par.enabled:
        return n
    t = torch.tensor([n], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
