"""``Dots3Worker``: the engine's worker for dots3-note's text model (``dots3_note``, ``models/dots3_note.py``).

It runs as GLM-5-Next's (``engine/glm5_worker.py``): each running sequence owns a state slot (``Glm5NextStateCache``
over ``Dots3State``), handed out by the scheduler's ``StateSlots`` and dropped when given back (finish, abort,
preemption: a preempted sequence recomputes from its first token). The block pool counts what grows with a sequence
(``bytes_per_token``: the indexed and full layers' latent rows and the indexer keys); the sliding layers' windows are
the fixed part of a slot (``state_bytes_per_sequence``), as a hybrid's linear-attention states are. Prefix caching
takes state snapshots as the hybrids do (``state_snapshot_memory``): each snapshot's windows are counted; the other
layers' rows it keeps are counted by the cached blocks once the sequence that took it has finished (while it runs,
they are a second copy of its prefix). A sequence resumed from a snapshot extends a copy of the prefix's rows of its
own, so it holds fresh blocks for them, as V4's does (``own_prefix_copies``). Under tensor parallelism each rank loads
and reads only its shard (``models/v4_shards.py``: each layer's share of its heads, its routed experts, slices of the
MLPs and of the vocabulary) and holds every slot's whole state, as V4's ranks do. What V4 refuses is refused here by
name (``check_v4_settings``). The vision and audio towers are not served: a prompt holding one of their placeholder
tokens fails with a message that says so.
"""

from __future__ import annotations

from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.v4_worker import V4Worker, check_v4_settings
from mla_runtime.errors import InvalidParam
from mla_runtime.models.dots3_note import Dots3Config, Dots3NoteForCausalLM, check_dots3_parallel, load_dots3_note
from mla_runtime.models.glm5_next import Glm5NextStateCache
from mla_runtime.models.row_sizes import dots3_kinds, dots3_model_config
from mla_runtime.parallel import SINGLE_RANK, ParallelContext

DOC = "docs/deepseek-v4.md"


class Dots3Worker(V4Worker):
    """The ``Worker`` of a ``dots3_note`` checkpoint (the module's docstring): same start-up calls, same steps."""

    def __init__(self, config: EngineConfig, par: ParallelContext = SINGLE_RANK) -> None:
        check_v4_settings(config, "dots3_note", DOC)
        raw = self._open(config, par)
        self.dots_config = Dots3Config.from_raw(raw)
        check_dots3_parallel(self.dots_config, config.tensor_parallel_size)
        text = raw.get("text_config") or raw
        cfg = self._settle(dots3_model_config(self.dots_config), text.get("dtype") or raw.get("dtype"))
        kinds = dots3_kinds(self.dots_config, self.dtype.itemsize)  # rows, keys, windows (models.row_sizes)
        self.bytes_per_token = self.bytes_per_token_per_rank = kinds.bytes_per_token
        self.state_bytes_per_sequence = kinds.window_bytes
        self.state_bytes = self.state_bytes_per_sequence * config.max_num_seqs
        self.num_state_snapshots = self._num_state_snapshots()
        self.state_snapshot_bytes = self.state_bytes_per_sequence * self.num_state_snapshots
        self._size_streams(cfg, lambda: Dots3NoteForCausalLM(self.dots_config, self.dtype, par), 0)
        self._unloaded()

    def _load_model(self) -> Dots3NoteForCausalLM:
        return load_dots3_note(self.model_path, self.dtype, self.par)

    def _new_states(self) -> Glm5NextStateCache:
        return Glm5NextStateCache(self.own_model, self.config.max_num_seqs, self.num_state_snapshots)

    def _allocation_line(self, num_blocks: int) -> str:
        snapshots = f"{self.num_state_snapshots} state snapshots" if self.prefix_caching else "off"
        return (f"dots3_note: {self.config.max_num_seqs} state slots of {self.state_bytes_per_sequence / 2**10:.1f} "
                f"KiB (the sliding layers' windows) plus {self.bytes_per_token} B per token (latents, indexer keys; "
                f"{num_blocks} blocks of {self.config.block_size} tokens); prefix caching: {snapshots}")

    @property
    def prefix_caching(self) -> bool:
        """As configured, with state snapshots (a cached prefix resumes from a copy of the state at its end)."""
        return self.config.enable_prefix_caching and self.num_state_snapshots > 0

    def check_prompt(self, ids: list[int]) -> None:
        """Refuse a prompt holding an image, video or audio placeholder token: only the text model is served."""
        media = sorted(set(ids) & self.dots_config.media_tokens)
        if media:
            raise InvalidParam("prompt", f"the prompt holds image/video/audio placeholder tokens {media}: "
                               f"dots3_note's vision and audio towers are not served (text prompts only; {DOC})")


__all__ = ["Dots3Worker"]
