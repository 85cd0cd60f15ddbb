"""Tensor-parallel worker ranks: one process per extra rank, driven by rank 0's single scheduler.

Two ways to start the ranks:
- one machine: rank 0 (the process that builds ``LLM``/the server) spawns ranks 1..N-1 itself;
- several machines: ``torchrun --nnodes M --nproc-per-node K script.py ...`` starts every rank; rank 0 runs
  the engine and every other rank calls ``run_torchrun_worker`` (``LLM`` and the server do that themselves), which
  returns when rank 0 shuts down.

Every rank is a ``Worker`` (``engine/worker.py``): it loads its shard, then runs the commands rank 0 broadcasts,
in the order rank 0 runs them on its own worker — ``truncate`` (the latent-rank calibration tokens, when
``latent_rank`` is set: every rank folds the same bases, computed on rank 0), ``allocate`` (the block count
rank 0 sized, so that every rank holds the same block ids), then one ``step`` per engine step (a ``StepInput``:
plain integer lists, from which each rank builds its own batch and attention metadata), and ``stop``. With lower
tiers of the prefix cache (``engine/kv_tier.py``) also ``kv_broadcast`` (receive blocks rank 0 loaded), and under
the sharded layout ``kv_store``, ``kv_load`` and ``kv_close`` (each rank keeps its shard's blocks). Rank 0
owns every decision (scheduler, block pool, sampling); the lm_head's vocabulary slices are gathered back on
rank 0. A rank that dies is noticed before the next broadcast (process liveness) or by the collective itself
(gloo reports the closed connection), and the step fails with ``RankDiedError`` instead of hanging.

The commands travel on a process group of their own whose timeout is ``COMMAND_TIMEOUT``: a worker waits for rank
0's next command as long as rank 0 lives, however long the engine idles or rank 0 takes to load (the collectives of
a step keep the group timeout, ``COLLECTIVE_TIMEOUT_S``, under which an idle engine's workers used to give up after
a minute and take the engine down with them).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mla_runtime import env
from mla_runtime.cache.disk_tier import agree_min, broadcast_blocks
from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.worker import StepInput, Worker, local_rank, rank_device
from mla_runtime.parallel import ParallelContext

logger = logging.getLogger("mla_runtime")
CPU = torch.device("cpu")  # the step messages travel as pickled objects on the CPU (gloo), whatever the devices
COLLECTIVE_TIMEOUT_S = 60.0  # the ranks' rendezvous and a step's collectives
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
    if "nccl" in backend:
        torch.cuda.set_device(local_rank(rank))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    _commands[0] = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)  # every rank, in the same order


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


def _receive() -> tuple:
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=_commands[0], device=CPU)
    return box[0]


def serve_worker(rank: int, world: int, config: EngineConfig) -> None:
    """Load this rank's shard and run rank 0's commands until it says stop."""
    worker = Worker(config, ParallelContext(rank, world, config.latent_cache_layout))
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
            dist.barrier()  # rank 0's ready(): every rank has its cache
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
        try:
            _init(0, world, init_method, timeout_s, self.backend)
        except Exception as e:
            self.check_alive()
            raise RankDiedError(f"tensor-parallel ranks did not join within {timeout_s:.0f} s: {e}") from e
        self.par = ParallelContext(0, world, config.latent_cache_layout)
        self.closed = False
        logger.info("tensor parallel: %d ranks (%s), %s latent cache", world, self.backend, config.latent_cache_layout)

    def send(self, kind: str, arg: object) -> None:
        """Broadcast one command (``truncate``, ``allocate``, ``step`` or ``draft``) to every worker rank."""
        self.check_alive()
        try:
            dist.broadcast_object_list([(kind, arg)], src=0, group=_commands[0], device=CPU)
        except RuntimeError as e:
            raise RankDiedError(f"tensor-parallel broadcast failed ({e}); a worker rank is gone") from e

    def broadcast_step(self, step: StepInput) -> None:
        self.send("step", step)

    def ready(self) -> None:
        """Wait until every rank has allocated its cache (after ``send("allocate", n)``)."""
        self.check_alive()
        dist.barrier()

    def check_alive(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise RankDiedError(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}; "
                                    f"the engine cannot continue — restart it")

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                dist.broadcast_object_list([("stop",)], src=0, group=_commands[0], device=CPU)
        except RuntimeError:
            pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
