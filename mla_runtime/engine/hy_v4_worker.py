"""``HyV4Worker``: the engine's worker for Hunyuan V4 (``hy_v4``, ``models/hy_v4.py``).

It runs as GLM-5-Next's (``engine/glm5_worker.py``): each running sequence owns a state slot (``Glm5NextStateCache``
over ``HyV4State``: every layer's latents and its indexer's keys), handed out by the scheduler's ``StateSlots`` and
dropped when given back (finish, abort, preemption: a preempted sequence recomputes from its first token); the block
pool counts what grows with a sequence (``bytes_per_token``: its latent rows and indexer keys, ``models.row_sizes``),
so the scheduler preempts when they would outgrow the budget. A step (any mix of prompts, prefill chunks and decodes)
runs ``HyV4ForCausalLM.forward_batch`` over the slots, in torch.

Prefix caching takes state snapshots as GLM-5-Next's does (``max_num_seqs`` of them; ``state_snapshot_memory`` 0
turns it off): a snapshot at a block boundary keeps the sequence's latents and keys up to there (tensors no step
writes into again), and a sequence that hits the prefix resumes from a copy. The cached blocks count those rows once
the sequence that took it has finished; while it runs, the snapshot's rows are a second copy of its prefix that the
block pool does not count (at most one prefix per snapshot). A sequence resumed from a snapshot extends a copy of the
prefix's rows of its own, so it holds fresh blocks for them, as V4's does (``own_prefix_copies``): the cached blocks go
back to the cache, still indexed. A snapshot the scheduler frees (its hash evicted, or the snapshot itself) drops its
rows at once, on every rank (``V4Worker.state_snapshots``). What V4 refuses is refused here by name
(``check_v4_settings``).

Under tensor parallelism (``tensor_parallel_size``) each rank loads and reads only its shard (``models/v4_shards.py``:
its heads, routed experts, slices of the MLPs and of the vocabulary) and holds every slot's whole state, as V4's ranks
do; the slots given back and snapshots freed on rank 0 reach the others with the next step.
"""

from __future__ import annotations

from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.v4_worker import V4Worker, check_v4_settings
from mla_runtime.models.glm5_next import Glm5NextStateCache
from mla_runtime.models.hy_v4 import HyV4Config, HyV4ForCausalLM, check_hy_v4_parallel, load_hy_v4
from mla_runtime.models.row_sizes import hy_v4_kinds, hy_v4_model_config
from mla_runtime.parallel import SINGLE_RANK, ParallelContext

DOC = "docs/deepseek-v4.md"


class HyV4Worker(V4Worker):
    """The ``Worker`` of a ``hy_v4`` checkpoint (the module's docstring): same start-up calls, same steps."""

    def __init__(self, config: EngineConfig, par: ParallelContext = SINGLE_RANK) -> None:
        check_v4_settings(config, "hy_v4", DOC)
        raw = self._open(config, par)
        self.hy_config = HyV4Config.from_raw(raw)
        check_hy_v4_parallel(self.hy_config, config.tensor_parallel_size)
        cfg = self._settle(hy_v4_model_config(self.hy_config), raw.get("dtype") or raw.get("torch_dtype"))
        kinds = hy_v4_kinds(self.hy_config, self.dtype.itemsize)  # latent rows, indexer keys (models.row_sizes)
        self.bytes_per_token = self.bytes_per_token_per_rank = kinds.bytes_per_token
        self.state_bytes_per_sequence = self.state_bytes = 0  # nothing fixed: all it keeps grows with the tokens
        off = not config.enable_prefix_caching or (config.state_snapshot_memory is not None
                                                   and not int(config.state_snapshot_memory))
        self.num_state_snapshots = 0 if off else config.max_num_seqs  # state_snapshot_memory 0: no prefix caching
        self.state_snapshot_bytes = 0  # nothing fixed: a snapshot holds the rows of its prefix (the module docstring)
        self._size_streams(cfg, lambda: HyV4ForCausalLM(self.hy_config, self.dtype, par), int(self.hy_config.hc_mult))
        self._unloaded()

    def _load_model(self) -> HyV4ForCausalLM:
        return load_hy_v4(self.model_path, self.dtype, self.par)

    def _new_states(self) -> Glm5NextStateCache:
        return Glm5NextStateCache(self.own_model, self.config.max_num_seqs, self.num_state_snapshots)

    def _allocation_line(self, num_blocks: int) -> str:
        snapshots = f"{self.num_state_snapshots} state snapshots" if self.prefix_caching else "off"
        return (f"hy_v4: {self.config.max_num_seqs} state slots, {self.bytes_per_token} B per token (latents, "
                f"indexer keys; {num_blocks} blocks of {self.config.block_size} tokens); prefix caching: {snapshots}")

    @property
    def prefix_caching(self) -> bool:
        """As configured, with state snapshots (a cached prefix resumes from a copy of the state at its end)."""
        return self.config.enable_prefix_caching and self.num_state_snapshots > 0


__all__ = ["HyV4Worker"]
