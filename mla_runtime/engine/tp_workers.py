"""Tensor-parallel worker ranks: one process per extra rank, driven by rank 0's single scheduler.

Two ways to start the ranks:
- one machine: rank 0 (the process that builds ``LLM``/the server) spawns ranks 1..N-1 itself;
- several machines: ``torchrun --nnodes M --nproc-per-node K script.py ...`` starts every rank; rank 0 runs
  the engine and every other rank calls ``run_torchrun_worker`` (``LLM`` and the server do that themselves), which
  returns when rank 0 shuts down.

Every rank is a ``Worker`` (``engine/worker.py``; ``make_worker``'s for a model of its own, DeepSeek-V4's
``V4Worker``): it loads its shard, then runs the commands rank 0 broadcasts, in the order rank 0 runs them on its own
worker — ``truncate`` (the latent-rank calibration tokens, when
``latent_rank`` is set: every rank folds the same bases, computed on rank 0), ``allocate`` (the block count
rank 0 sized, so that every rank holds the same block ids), then one ``step`` per engine step (a ``StepInput``:
plain integer lists, from which each rank builds its own batch and attention metadata), and ``stop``. With lower
tiers of the prefix cache (``engine/kv_tier.py``) also ``kv_broadcast`` (receive blocks rank 0 loaded), and under
the sharded layout ``kv_store``, ``kv_load`` and ``kv_close`` (each rank keeps its shard's blocks). Rank 0
owns every decision (scheduler, block pool, sampling); the lm_head's vocabulary slices are gathered back on
rank 0. A rank that dies is noticed before the next broadcast (process liveness) or by the collective itself
(gloo reports the closed connection), and the step fails with ``RankDiedError`` instead of hanging.

The commands travel on a process group of their own whose timeout is ``COMMAND_TIMEOUT``: a worker waits for rank
0's next command as long as rank 0 lives, however long the engine idles or rank 0 takes to load. Only the
collectives of a step keep the group timeout, ``COLLECTIVE_TIMEOUT_S``: idle time is not a fault.

Start-up has two waits, both on rank 0, both bounded by ``MLA_TP_WAIT_S`` (900 s by default: a rank on another machine
may start minutes later, and a real-size shard may load minutes slower than rank 0's) and logged every
``WAIT_LOG_S`` with what is awaited and for how long: the ranks joining (the rendezvous, ``_join``), and, once rank 0
has sized the cache, every rank loaded and holding its cache (``ready``, a barrier on the command group). A spawned
rank that dies meanwhile fails the start at once, with its exit code.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mla_runtime import env
from mla_runtime.cache.disk_tier import agree_min, broadcast_blocks
from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.v4_worker import make_worker
from mla_runtime.engine.worker import StepInput, Worker, local_rank, rank_device
from mla_runtime.parallel import ParallelContext

logger = logging.getLogger("mla_runtime")
CPU = torch.device("cpu")  # the step messages travel as pickled objects on the CPU (gloo), whatever the devices
COLLECTIVE_TIMEOUT_S = 60.0  # a step's collectives
WAIT_LOG_S = 10.0  # s between rank 0's log lines while it waits for the other ranks at start-up
STOP_WAIT_S = 10.0  # s rank 0 waits at shutdown for the ranks to take the stop command, then for them to exit
COMMAND_TIMEOUT = timedelta(days=365)  # a worker waiting for rank 0's next command: idle time is not a fault
_commands: list[Any] = [None]  # this process's command group (``_init``)


class RankDiedError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads_per_rank(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def launched_by_torchrun() -> bool:
    return (env.torchrun_world_size() or 1) > 1


def torchrun_rank() -> int:
    return env.torchrun_rank()


def is_torchrun_worker(config: EngineConfig) -> bool:
    """This process is a tensor-parallel rank other than 0, started by torchrun (it runs ``run_torchrun_worker``)."""
    return config.tensor_parallel_size > 1 and launched_by_torchrun() and torchrun_rank() != 0


def collective_backend(config: EngineConfig, world: int) -> str:
    """``gloo`` for ranks on CPUs; with a GPU per rank, NCCL for the tensors on the GPUs and gloo for the step
    messages (pickled objects on the CPU)."""
    on_gpus = rank_device(config.device, world, 0).type == "cuda"
    return "cpu:gloo,cuda:nccl" if on_gpus else "gloo"


def _init(rank: int, world: int, init_method: str, timeout_s: float, backend: str = "gloo") -> None:
    """Join the ranks: a rendezvous that waits up to ``MLA_TP_WAIT_S`` for all of them, then the process group, whose
    collectives time out after ``timeout_s``, and the command group."""
    if "nccl" in backend:
        torch.cuda.set_device(local_rank(rank))
    store, rank, world = next(dist.rendezvous(init_method, rank, world, timeout=timedelta(seconds=env.tp_wait_s())))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    _commands[0] = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)  # every rank, in the same order


def _slow_load() -> None:
    """The test hook ``MLA_FAULT_INJECTION=slow_load:K``: a worker rank's load takes K s longer."""
    seconds = env.injected_fault("slow_load")
    if seconds is not None:
        time.sleep(seconds)


def worker_main(rank: int, world: int, init_method: str, config: EngineConfig, timeout_s: float) -> None:
    """Entry point of a spawned worker rank."""
    torch.set_num_threads(_threads_per_rank(world))
    _init(rank, world, init_method, timeout_s, collective_backend(config, world))
    serve_worker(rank, world, config)


def run_torchrun_worker(config: EngineConfig, timeout_s: float | None = None) -> None:
    """On a torchrun rank other than 0: serve rank 0's steps; returns when rank 0 stops."""
    timeout_s = COLLECTIVE_TIMEOUT_S if timeout_s is None else timeout_s
    world = env.torchrun_world_size()
    if world is None:
        raise RuntimeError("run_torchrun_worker needs a process started by torchrun")
    if world != config.tensor_parallel_size:
        raise ValueError(f"torchrun started {world} ranks but tensor_parallel_size is {config.tensor_parallel_size}")
    _init(torchrun_rank(), world, "env://", timeout_s, collective_backend(config, world))
    serve_worker(torchrun_rank(), world, config)


def _post(command: tuple) -> list[Any]:
    """Rank 0: broadcast one command (pickled: its length, then its bytes) on the command group, without waiting for
    the other ranks to take it; the two ``Work`` handles. (``broadcast_object_list`` blocks rank 0 until every rank
    has taken it, however long a rank still loading takes, with nothing to say meanwhile.)"""
    data = torch.frombuffer(bytearray(pickle.dumps(command)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    return [dist.broadcast(t, src=0, group=_commands[0], async_op=True) for t in (size, data)]


def _receive() -> tuple:
    """A worker rank: the next command of rank 0's ``_post``."""
    size = torch.zeros(1, dtype=torch.long)
    dist.broadcast(size, src=0, group=_commands[0])
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=_commands[0])
    command: tuple = pickle.loads(data.numpy().tobytes())
    return command


def serve_worker(rank: int, world: int, config: EngineConfig) -> None:
    """Load this rank's shard and run rank 0's commands until it says stop."""
    worker = make_worker(config, ParallelContext(rank, world, config.latent_cache_layout))
    _slow_load()
    worker.load()
    while (command := _receive())[0] != "stop":
        kind, arg = command
        if kind == "step":
            worker.execute(arg)
        elif kind == "draft":
            worker.draft(arg)
        elif kind == "truncate":
            worker.truncate_latent(arg)
        elif kind == "allocate":
            worker.allocate(arg)
            worker.open_lower_tier()
            dist.barrier(group=_commands[0])  # rank 0's ready(): every rank has its cache
        elif kind.startswith("kv_"):
            _lower_tier_command(worker, kind, arg)
    if worker.lower_tier is not None:
        worker.lower_tier.close(0)
    dist.destroy_process_group()


def _lower_tier_command(worker: Worker, kind: str, arg: Any) -> None:
    """A lower-tier command of rank 0's ``LowerTierDriver`` (engine/kv_tier.py)."""
    tier = worker.lower_tier
    if kind == "kv_broadcast":
        assert worker.cache is not None
        broadcast_blocks(worker.cache, arg, worker.par)
        return
    assert tier is not None
    if kind == "kv_store":
        pairs, wait = arg
        for h, b in pairs:
            tier.store(h, b, wait=wait)
    elif kind == "kv_load":
        agree_min(tier.load(*arg), worker.par)
    elif kind == "kv_close":
        tier.close(arg)


class TensorParallelGroup:
    """Rank 0's side: starts the worker ranks and broadcasts each command to them."""

    def __init__(self, config: EngineConfig, timeout_s: float | None = None) -> None:
        timeout_s = COLLECTIVE_TIMEOUT_S if timeout_s is None else timeout_s
        env.tp_wait_s()  # a bad MLA_TP_WAIT_S fails here, before any rank starts
        world = config.tensor_parallel_size
        self.procs: list = []
        if launched_by_torchrun():  # the other ranks exist already, maybe on other machines
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            ctx = mp.get_context("spawn")
            self.procs = [ctx.Process(target=worker_main, name=f"mla-tp-rank{r}", daemon=True,
                                      args=(r, world, init_method, config, timeout_s)) for r in range(1, world)]
            for p in self.procs:
                p.start()
            torch.set_num_threads(_threads_per_rank(world))
        self.backend = collective_backend(config, world)
        self._join(world, init_method, timeout_s)
        self.par = ParallelContext(0, world, config.latent_cache_layout)
        self.closed = False
        logger.info("tensor parallel: %d ranks (%s), %s latent cache", world, self.backend, config.latent_cache_layout)

    def _join(self, world: int, init_method: str, timeout_s: float) -> None:
        """Rank 0's rendezvous, run beside a loop that logs the wait and notices a spawned rank that died."""
        failed: list[BaseException] = []

        def init() -> None:
            try:
                _init(0, world, init_method, timeout_s, self.backend)
            except BaseException as e:  # noqa: BLE001 - reported by the waiting thread
                failed.append(e)

        joining = threading.Thread(target=init, name="mla-tp-join", daemon=True)
        joining.start()
        start = time.monotonic()
        while joining.is_alive():
            joining.join(WAIT_LOG_S)
            if joining.is_alive():
                self.check_alive()
                logger.info("tensor parallel: waiting %.0f s (up to %.0f s, %s) for %d more ranks to join at %s",
                            time.monotonic() - start, env.tp_wait_s(), env.TP_WAIT, world - 1, init_method)
        if failed:
            self.check_alive()
            raise RankDiedError(f"tensor-parallel ranks did not join within {env.tp_wait_s():.0f} s "
                                f"({env.TP_WAIT}): {failed[0]}") from failed[0]
        logger.info("tensor parallel: %d ranks joined in %.1f s", world, time.monotonic() - start)

    def send(self, kind: str, arg: object, awaiting: str | None = None) -> None:
        """Broadcast one command (``truncate``, ``allocate``, ``step``, ``draft`` or a lower tier's) to every worker
        rank. ``awaiting``: a start-up command, which a rank takes once it has loaded its shard (what it is waited
        for, in the log lines): waited for up to ``MLA_TP_WAIT_S`` (``_await``)."""
        self.check_alive()
        try:
            works = _post((kind, arg))
            if awaiting is not None:
                self._await(works, awaiting)
            for work in works:
                work.wait()
        except RuntimeError as e:
            raise RankDiedError(f"tensor-parallel broadcast failed ({e}); a worker rank is gone") from e

    def _await(self, works: list[Any], what: str) -> None:
        """Wait for start-up ``works`` up to ``MLA_TP_WAIT_S``, logging the wait every ``WAIT_LOG_S`` and failing at
        once where a spawned rank died."""
        deadline = env.tp_wait_s()
        start = last = time.monotonic()
        while not all(w.is_completed() for w in works):
            self.check_alive()
            now = time.monotonic()
            if now - start > deadline:
                raise RankDiedError(f"tensor-parallel ranks did not {what} within {deadline:.0f} s ({env.TP_WAIT})")
            if now - last >= WAIT_LOG_S:
                last = now
                logger.info("tensor parallel: waiting %.0f s (up to %.0f s, %s) for the other ranks to %s",
                            now - start, deadline, env.TP_WAIT, what)
            time.sleep(0.01)

    def broadcast_step(self, step: StepInput) -> None:
        self.send("step", step)

    def ready(self) -> None:
        """Wait until every rank has loaded its shard and allocated its cache (after ``send("allocate", n)``), up to
        ``MLA_TP_WAIT_S``, logging the wait every ``WAIT_LOG_S``."""
        self.check_alive()
        work = dist.barrier(group=_commands[0], async_op=True)
        self._await([work], "allocate their caches")
        work.wait()

    def check_alive(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise RankDiedError(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}; "
                                    f"the engine cannot continue — restart it")

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True

        def stop() -> None:
            try:
                for work in _post(("stop",)):
                    work.wait()
            except RuntimeError:
                pass

        # a rank still loading (a start that failed on MLA_TP_WAIT_S) takes the command later, or never: bounded
        stopping = threading.Thread(target=stop, name="mla-tp-stop", daemon=True)
        if all(p.is_alive() for p in self.procs):
            stopping.start()
            stopping.join(STOP_WAIT_S)
        for p in self.procs:
            p.join(timeout=STOP_WAIT_S)
            if p.is_alive():
                p.terminate()
                p.join(timeout=STOP_WAIT_S)
        if stopping.is_alive():  # a stop still posted to a rank that never took it: its connection is closed now
            stopping.join(STOP_WAIT_S)
        if dist.is_initialized() and not stopping.is_alive():
            dist.destroy_process_group()
        elif dist.is_initialized():
            logger.warning("tensor parallel: the stop command is still in flight; the process group is left open")
