"""Decode steps under CUDA graphs: one graph per padded batch size, replayed over static input buffers.

A *pure decode* step (every sequence brings one new token) of ``B`` sequences runs as the graph of the smallest
captured size ``S >= B`` (a *bucket*: ``cuda_graph_sizes``, by default 1, 2, 4 and the multiples of 8 up to the first
that holds ``max_num_seqs``, at most 512). Every other step — prefill chunks, speculative verifications, a decode
larger than the largest bucket, a bucket whose capture failed — runs eagerly, as without graphs.

**Static buffers.** Allocated once for the largest bucket; bucket ``S`` reads their first ``S`` rows: token ids,
positions, slot mapping, sequence lengths (the keys each row sees: also the batch's ``token_seq_lens``), context
lengths, ``seq_start_loc``, and a block table of fixed width ``ceil(max_model_len / block_size)``; the query offsets,
the row → block-table-row map and the logits indices of a decode are ``arange`` and never change. A step writes its
rows into them with ``copy_`` (a few host-to-device copies); nothing inside the captured region makes a tensor from
host data. Block-table columns past a row's own blocks keep whatever an earlier step left there: the kernels never
read a block past a row's length.

**Padding rows** (rows ``B..S-1``): token 0 at position 0, slot ``-1`` (the store kernels skip negative slots: no
cache write), one visible key, and a block-table row of block 0 — a padding row attends over key 0 of block 0,
read-only, whatever it holds. Every op of the model is row-wise (projections, norms, MLPs, the experts' sums per
token, attention per query row), so a padding row changes no real row; its outputs are dropped. The tests check it.

**What is captured.** ``Worker.forward`` — the same function an eager step runs: the attention backend's ``prepare``
(RoPE tables gathered from the whole-``max_model_len`` table by the positions tensor), every layer (latent store and
absorbed decode attention), the final norm; the logits of the real rows are computed after the replay, eagerly. The
``ForwardBatch`` of a bucket is made once, over views of the buffers, with the host-side lists a capture freezes set to
the worst case (every row at ``max_model_len``): RoPE's table then covers every position before the capture, and every
host-side choice made from those lists (the path, the sparse indexer's top-k) holds for any real step. The split-KV
decode kernel picks its partition count from shapes only (rows = the bucket, keys bounded by the block table's fixed
width), so it is fixed per bucket.

**Host syncs.** Before each capture the bucket runs eagerly twice: a warm-up (compiling kernels, building what is
built on first use), then a pass under ``count_host_syncs``. A bucket whose step reads a tensor's values back on the
host (a capture would fail on it: today the host-side grouping of routed experts in ``layers/moe.py``, which every MoE
layer takes unless its experts are block-FP8 on CUDA) is not captured: its steps run eagerly and the reason is
logged. Any other capture failure (memory, say) does the same; neither ever stops the engine.

**The stand-in** (``cuda_graph_mode="stand-in"``): the same runner, buffers, padding and bucket choice, on any device,
but a "replay" runs ``Worker.forward`` eagerly on the bucket's batch instead of a graph. It is what the tests run on a
CPU (with the ``torch`` or ``triton`` backend; the CPU backend's planned decode takes no part), and on a GPU it tells
a capture problem from a padding one.

Off: ``enforce_eager``; tensor parallelism (the collectives are not captured); MTP drafting (its pass reads the eager
step's batch); the CPU attention backend.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from mla_runtime.engine.worker import StepInput, Worker
from mla_runtime.families import OWN_MODEL
from mla_runtime.forward_batch import ForwardBatch

logger = logging.getLogger("mla_runtime")

DEFAULT_MAX_SIZE = 512  # the default buckets stop here
PAD_BLOCK = 0  # the block a padding row reads its one key from (read-only)

# the Tensor methods that read values back to the host (on CUDA: wait for the device), and torch's functions that do
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "unique", "__int__", "__float__", "__bool__",
                "__index__")
SYNC_FUNCTIONS = ("nonzero", "unique")


def default_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4 and the multiples of 8 up to the first size that holds ``max_num_seqs`` (at most 512)."""
    sizes = [1, 2, 4, *range(8, DEFAULT_MAX_SIZE + 1, 8)]
    cover = next((s for s in sizes if s >= max_num_seqs), sizes[-1])
    return tuple(s for s in sizes if s <= cover)


@contextmanager
def count_host_syncs() -> Iterator[list[str]]:
    """Within the block, record each read of a tensor's values back to the host made by this thread, as
    ``"method at file:line"`` of its caller: ``Tensor.item``, ``tolist``, ``cpu``, ``numpy``, ``nonzero``, ``unique``,
    ``int()``, ``float()``, ``bool()`` and ``operator.index`` of a tensor, ``torch.nonzero`` and ``torch.unique``.
    Reads made from inside the Triton package (its CPU interpreter) are the interpreter's, not the step's, and are left
    out. Reads that torch makes in C++ (boolean-mask indexing) are not seen."""
    found: list[str] = []
    owner = threading.get_ident()

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == owner:
                site = _caller()
                if site is not None:
                    found.append(f"{name} at {site}")
            return original(*args, **kwargs)
        return wrapper

    methods = {name: torch.Tensor.__dict__.get(name) for name in SYNC_METHODS}
    functions = {name: getattr(torch, name) for name in SYNC_FUNCTIONS}
    try:
        for name in SYNC_METHODS:
            setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
        for name, fn in functions.items():
            setattr(torch, name, counted(f"torch.{name}", fn))
        yield found
    finally:
        for name, original in methods.items():
            if original is None:  # inherited from the C base class: drop the override
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        for name, fn in functions.items():
            setattr(torch, name, fn)


def _caller() -> str | None:
    """``file:line`` of the frame that called a counted method (None: the Triton package's own)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return None
    path = frame.f_code.co_filename.replace("\\", "/")
    if "/triton/" in path:
        return None
    for root in ("/mla_runtime/", "/mla_kernels/", "/site-packages/"):
        if root in path:
            path = root.strip("/") + "/" + path.split(root, 1)[1]
            break
    return f"{path}:{frame.f_lineno}"


class _Replay:
    """One bucket's runnable step: ``run()`` -> the hidden states of all its rows (padding included)."""

    def run(self) -> torch.Tensor:
        raise NotImplementedError


class _Captured(_Replay):
    def __init__(self, graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> None:
        self.graph, self.out = graph, out

    def run(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class _StandIn(_Replay):
    """The stand-in's "replay": the step eagerly, on the bucket's batch over the static buffers."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], batch: ForwardBatch) -> None:
        self.forward, self.batch = forward, batch

    def run(self) -> torch.Tensor:
        return self.forward(self.batch)


class DecodeGraphs:
    """The decode graphs of one worker (see the module's docstring). ``capture_all()`` once the cache is allocated;
    then ``run(step)`` per step: the hidden states ``[B, d]`` of a pure decode step it takes, None for any other."""

    def __init__(self, worker: Worker, sizes: Sequence[int], stand_in: bool) -> None:
        assert worker.model is not None and worker.cache is not None
        self.worker, self.cache = worker, worker.cache
        self.stand_in = stand_in
        self.device = worker.device
        self.sizes = tuple(sorted(set(sizes)))
        self.block_size = worker.config.block_size
        self.max_model_len = worker.max_model_len
        self.width = math.ceil(self.max_model_len / self.block_size)  # block-table columns
        n, dev = self.sizes[-1], self.device
        # int64 rows: input ids, positions, slots; int32 rows: sequence lengths (= token_seq_lens), context lengths
        self.ids64 = torch.zeros(3, n, dtype=torch.int64, device=dev)
        self.ids64[2] = -1
        self.ints32 = torch.zeros(2, n, dtype=torch.int32, device=dev)
        self.ints32[0] = 1
        self.seq_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((n, self.width), PAD_BLOCK, dtype=torch.int32, device=dev)
        # the same in every decode step
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.token_req_idx = torch.arange(n, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self.replays: dict[int, _Replay] = {}
        self.failures: dict[int, str] = {}  # bucket -> why its steps run eagerly
        self.syncs: dict[int, list[str]] = {}  # bucket -> the host reads its warm-up made
        self.pool: Any = None  # the captured graphs' shared memory pool (CUDA)
        self.runs: Counter[int] = Counter()  # steps replayed per bucket
        self.check_syncs = False  # count the host reads of every replay into last_syncs (tests)
        self.last_syncs: list[str] = []

    def batch(self, size: int) -> ForwardBatch:
        """The bucket's batch over the first ``size`` rows of the buffers; its host lists are the worst case (every
        row at ``max_model_len``), which every host-side choice a capture freezes holds for."""
        return ForwardBatch(
            input_ids=self.ids64[0, :size], positions=self.ids64[1, :size], slot_mapping=self.ids64[2, :size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.ints32[0, :size],
            seq_start_loc=self.seq_start_loc[:size + 1], context_lens=self.ints32[1, :size],
            block_tables=self.block_tables[:size], token_seq_lens=self.ints32[0, :size],
            token_req_idx=self.token_req_idx[:size], logits_indices=self.logits_indices[:size],
            query_lens=[1] * size, context_lens_list=[self.max_model_len - 1] * size, block_size=self.block_size)

    # -- start-up ----------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture (or, for the stand-in, prepare) every bucket, largest first (they share one memory pool); a bucket
        that fails is logged and its steps run eagerly."""
        t0 = time.monotonic()
        on_cuda = self.device.type == "cuda" and not self.stand_in
        if on_cuda:
            self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            try:
                self.replays[size] = self.capture(size)
            except Exception as e:  # noqa: BLE001 - any failure: that bucket runs eagerly
                self.failures[size] = reason = f"{type(e).__name__}: {e}".strip()
                logger.warning("decode steps of %d sequences: no CUDA graph (%s); they run eagerly", size, reason)
                if on_cuda:
                    try:
                        torch.cuda.synchronize(self.device)
                    except Exception as sync_error:  # noqa: BLE001 - reported; the eager steps will say more
                        logger.warning("after the failed capture the device reports: %s", sync_error)
        done = sorted(self.replays)
        what = "stand-in (no capture) for" if self.stand_in else "CUDA graphs captured for"
        logger.info("decode %s batch sizes %s in %.1f s%s", what, ",".join(map(str, done)) or "none",
                    time.monotonic() - t0, f"; eager: {','.join(map(str, sorted(self.failures)))}"
                    if self.failures else "")

    def capture(self, size: int) -> _Replay:
        """One bucket: a warm-up step on padding rows only, a second one counting its host reads (what a capture
        records: the first has made what is made once, such as compiled kernels and lazily built tables), then its
        graph."""
        self.write_padding(size)
        batch = self.batch(size)
        self.warm_up(batch)
        with count_host_syncs() as syncs:
            self.warm_up(batch)
        if syncs:
            self.syncs[size] = syncs
        if self.stand_in:
            if syncs:
                logger.warning("decode stand-in, %d sequences: %d host read(s) a capture would fail on, first %s",
                               size, len(syncs), syncs[0])
            return _StandIn(self.worker.forward, batch)
        if syncs:
            raise RuntimeError(f"the step reads tensors back on the host {len(syncs)} time(s), first {syncs[0]}")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self.worker.forward(batch)
        return _Captured(graph, out)

    def warm_up(self, batch: ForwardBatch) -> None:
        """One eager step (on a side stream on CUDA, as a capture wants): compiles the kernels and builds the RoPE
        table for every position up to ``max_model_len``."""
        if self.device.type != "cuda":
            self.worker.forward(batch)
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.worker.forward(batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    # -- steps -------------------------------------------------------------------------------------------------------
    def bucket(self, step: StepInput) -> int | None:
        """The bucket a step replays (None: it runs eagerly)."""
        chunks = step.token_chunks
        n = len(chunks)
        if n == 0 or n > self.sizes[-1] or self.worker.cache is not self.cache or any(len(c) != 1 for c in chunks):
            return None
        size = next(s for s in self.sizes if s >= n)
        return size if size in self.replays else None

    def run(self, step: StepInput) -> torch.Tensor | None:
        """The hidden states ``[B, d]`` of the step's rows, replayed; None for a step it does not take."""
        size = self.bucket(step)
        if size is None:
            return None
        self.write_step(step, size)
        replay = self.replays[size]
        if self.check_syncs:
            with count_host_syncs() as found:
                out = replay.run()
            self.last_syncs = found
        else:
            out = replay.run()
        self.runs[size] += 1
        return out[:len(step.token_chunks)]

    def write_step(self, step: StepInput, size: int) -> None:
        """Copy the step's rows into the buffers' first ``size`` rows, padding after them."""
        bs, pad = self.block_size, size - len(step.token_chunks)
        ctx = list(step.context_lens)
        tables = [t[:self.width] for t in step.block_tables]
        slots = [t[p // bs] * bs + p % bs for p, t in zip(ctx, tables)]
        self.ids64[:, :size].copy_(torch.tensor([[c[0] for c in step.token_chunks] + [0] * pad, ctx + [0] * pad,
                                                 slots + [-1] * pad], dtype=torch.int64), non_blocking=True)
        lens = [p + 1 for p in ctx] + [1] * pad
        self.ints32[:, :size].copy_(torch.tensor([lens, ctx + [0] * pad], dtype=torch.int32), non_blocking=True)
        starts = [0]
        for k in lens:
            starts.append(starts[-1] + k)
        self.seq_start_loc[:size + 1].copy_(torch.tensor(starts, dtype=torch.int32), non_blocking=True)
        width = max(len(t) for t in tables)
        rows = [t + [PAD_BLOCK] * (width - len(t)) for t in tables] + [[PAD_BLOCK] * width] * pad
        self.block_tables[:size, :width].copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)

    def write_padding(self, size: int) -> None:
        """The first ``size`` rows as padding rows only (what a capture sees)."""
        self.ids64[:2, :size] = 0
        self.ids64[2, :size] = -1
        self.ints32[0, :size] = 1
        self.ints32[1, :size] = 0
        self.seq_start_loc[:size + 1].copy_(torch.arange(size + 1, dtype=torch.int32))
        self.block_tables[:size] = PAD_BLOCK


def start_decode_graphs(worker: Worker) -> DecodeGraphs | None:
    """The engine's start-up hook, once the cache is allocated: the worker's decode graphs, captured (or the
    stand-in) and plugged into ``worker.execute``; None where they are off (logged)."""
    c = worker.config
    if c.enforce_eager:
        return None
    stand_in = c.cuda_graph_mode == "stand-in"
    if not stand_in and worker.device.type != "cuda":
        return None
    reason = None
    if c.tensor_parallel_size > 1:
        reason = "tensor parallelism"
    elif worker.num_mtp_layers:
        reason = "MTP drafting reads the eager step's batch"
    elif worker.model_config.family in OWN_MODEL:
        reason = f"{worker.model_config.family} runs its steps in torch over the sequences' state slots"
    elif worker.model_config.linear_attention is not None:
        reason = "a hybrid model's linear-attention layers run eagerly"
    elif worker.resolved.attention_backend == "cpu":
        reason = "the CPU attention backend plans its own decodes"
    if reason is not None:
        logger.info("CUDA graphs off: %s", reason)
        return None
    graphs = DecodeGraphs(worker, c.cuda_graph_sizes or default_sizes(c.max_num_seqs), stand_in)
    graphs.capture_all()
    worker.graphs = graphs
    return graphs
