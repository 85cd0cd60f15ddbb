"""Tensor-parallel worker ranks: one process per extra rank, driven by rank 0's single scheduler.

Two ways to start the ranks:
- one machine: rank 0 (the process that builds ``LLM``/the server) spawns ranks 1..N-1 itself;
- several machines: ``torchrun --nnodes M --nproc-per-node K script.py ...`` starts every rank; rank 0
  proceeds as the engine and, on every other rank, constructing the engine runs the worker loop instead
  and exits the process when rank 0 shuts down — so the same script serves on all ranks.

Rank 0 owns every decision (scheduler, block pool, sampling). Each step it broadcasts the step's
``ForwardBatch`` — input ids, positions, slot mapping, block tables, sequence lengths — once; every rank
runs its shard of the model on it against its own latent cache, which uses the same block ids; the
lm_head's vocabulary slices are gathered back on rank 0. With ``latent_rank`` set, the ranks truncate
the latent together after loading (``latent_rank.truncate_latent_rank``: rank 0 broadcasts the calibration
tokens, computes the bases and broadcasts them) before sizing their caches. A rank that dies is noticed before the next
broadcast (process liveness) or by the collective itself (gloo reports the closed connection), and the
step fails with ``RankDiedError`` instead of hanging.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.engine.config import EngineConfig
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.latent_rank import truncate_latent_rank
from mla_runtime.loader import load_model
from mla_runtime.parallel import ParallelContext

logger = logging.getLogger("mla_runtime")


class RankDiedError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_cache(model, num_blocks: int, config: EngineConfig, cache_dtype: torch.dtype,
               par: ParallelContext, device: torch.device) -> LatentCache:
    """This rank's latent cache: all tokens (replicated) or every N-th token (sharded)."""
    block = config.block_size // par.world_size if par.sharded_cache else config.block_size
    cfg = model.config
    return LatentCache(cfg.num_hidden_layers, num_blocks, block, cfg.latent_dim, cache_dtype, device)


def _threads_per_rank(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def torchrun_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _init(rank: int, world: int, init_method: str, timeout_s: float) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def worker_main(rank: int, world: int, init_method: str, config: EngineConfig, timeout_s: float) -> None:
    """Entry point of a spawned worker rank."""
    torch.set_num_threads(_threads_per_rank(world))
    _init(rank, world, init_method, timeout_s)
    serve_worker(rank, world, config)


def run_torchrun_worker(config: EngineConfig, timeout_s: float = 60.0) -> None:
    """On a torchrun rank other than 0: serve rank 0's steps, then end the process."""
    world = int(os.environ["WORLD_SIZE"])
    if world != config.tensor_parallel_size:
        raise ValueError(f"torchrun started {world} ranks but tensor_parallel_size is {config.tensor_parallel_size}")
    _init(torchrun_rank(), world, "env://", timeout_s)
    serve_worker(torchrun_rank(), world, config)
    raise SystemExit(0)


def serve_worker(rank: int, world: int, config: EngineConfig) -> None:
    """Load this rank's shard and run every step rank 0 broadcasts, until it says stop."""
    box: list = [None]
    dist.broadcast_object_list(box, src=0)
    _, num_blocks, cache_dtype = box[0]  # ("init", blocks, cache dtype): rank 0 sized the cache
    par = ParallelContext(rank, world, config.latent_cache_layout)
    device = torch.device("cpu")
    model = load_model(config.model, dtype=config.dtype, attention_path=config.attention_path,
                       backend=config.attention_backend, device=device, par=par)
    if config.latent_rank is not None:
        box = [None]
        dist.broadcast_object_list(box, src=0)  # ("latent", calibration chunks), or ("stop",) if rank 0 failed
        if box[0][0] == "stop":
            dist.destroy_process_group()
            return
        truncate_latent_rank(model, config.latent_rank, config.latent_projection, box[0][1])
    cache = make_cache(model, num_blocks, config, cache_dtype, par, device)
    dist.barrier()
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        command = box[0]
        if command[0] == "stop":
            break
        _, batch, token_rows = command
        with torch.inference_mode():
            hidden = model(batch, cache)
            if token_rows:
                model.compute_logits(hidden[token_rows])
    dist.destroy_process_group()


class TensorParallelGroup:
    """Rank 0's side: starts the worker ranks and broadcasts each step to them."""

    def __init__(self, config: EngineConfig, num_blocks: int, cache_dtype: torch.dtype,
                 timeout_s: float = 60.0) -> None:
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
        try:
            _init(0, world, init_method, timeout_s)
        except Exception as e:
            self.check_alive()
            raise RankDiedError(f"tensor-parallel ranks did not join within {timeout_s:.0f} s: {e}") from e
        dist.broadcast_object_list([("init", num_blocks, cache_dtype)], src=0)
        self.par = ParallelContext(0, world, config.latent_cache_layout)
        self.closed = False
        logger.info("tensor parallel: %d ranks (gloo), %s latent cache", world, config.latent_cache_layout)

    def ready(self) -> None:
        """Wait until every rank has loaded its shard."""
        self.check_alive()
        dist.barrier()

    def send_calibration(self, calibration: list[list[int]] | None) -> None:
        """Start the ranks' latent-rank truncation: they receive the calibration token chunks (None for svd)."""
        self.check_alive()
        dist.broadcast_object_list([("latent", calibration)], src=0)

    def check_alive(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise RankDiedError(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}; "
                                    f"the engine cannot continue — restart it")

    def broadcast_step(self, batch: ForwardBatch, token_rows: list[int]) -> None:
        """Send the step to every rank: the batch and the tokens whose logits it needs."""
        self.check_alive()
        try:
            dist.broadcast_object_list([("step", batch, token_rows)], src=0)
        except RuntimeError as e:
            raise RankDiedError(f"tensor-parallel broadcast failed ({e}); a worker rank is gone") from e

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                dist.broadcast_object_list([("stop",)], src=0)
        except RuntimeError:
            pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
