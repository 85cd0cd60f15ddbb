"""``Glm5NextWorker``: the engine's worker for GLM-5-Next's text model (``glm5_next``, ``models/glm5_next.py``).

It runs as DeepSeek-V4's (``engine/v4_worker.py``): each running sequence owns a state slot (``Glm5NextStateCache``:
its MLA layers' latents and indexer keys, its linear layers' recurrent and convolution states), handed out by the
scheduler's ``StateSlots`` and dropped when given back (finish, abort, preemption: a preempted sequence recomputes
from its first token); the block pool counts what grows with a sequence, its latent rows and indexer keys
(``bytes_per_token``), so the scheduler preempts when they would outgrow the budget. A step (any mix of prompts,
prefill chunks and decodes) runs ``Glm5NextForCausalLM.forward_batch`` over the slots, in torch.

Prefix caching works as for the other hybrids (``docs/hybrid-models.md``): the scheduler's state snapshots at block
boundaries are copies of a sequence's state (``Glm5NextState.copy``: its linear layers' states copied, its latents
and indexer keys shared, as no step writes into them), taken during the step that computes the boundary's token
(``ForwardBatch.state_snapshots``) and copied into the slot of a sequence that hits the prefix
(``StepInput.state_restores``). The restored sequence's first step extends a copy of the prefix's latents and keys of
its own, so it holds fresh blocks for them, as V4's does (``own_prefix_copies``); a snapshot the scheduler frees drops
its rows at once (``V4Worker.state_snapshots``). What V4 refuses is refused here by
name (``check_v4_settings``): it runs on one rank. The vision tower is
not served: a prompt holding an image or video placeholder token fails with a message that says so.
"""

from __future__ import annotations

import logging

import torch

from mla_runtime.cache.state_cache import StateCache
from mla_runtime.config import ModelConfig
from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.v4_worker import V4Worker, check_v4_settings
from mla_runtime.errors import InvalidParam
from mla_runtime.models.glm5_next import Glm5NextConfig, Glm5NextForCausalLM, Glm5NextStateCache, load_glm5_next
from mla_runtime.parallel import SINGLE_RANK, ParallelContext

logger = logging.getLogger("mla_runtime")
DOC = "docs/hybrid-models.md"


def model_config(cfg: Glm5NextConfig) -> ModelConfig:
    """What the engine reads of any model (vocabulary, special tokens, context, widths) for a GLM-5-Next checkpoint:
    its latent is ``kv_lora_rank`` wide, with no RoPE dims."""
    g = cfg.g
    return ModelConfig(
        family="glm5_next", model_type="glm5_next", vocab_size=int(g["vocab_size"]), hidden_size=int(g["hidden_size"]),
        intermediate_size=int(g["intermediate_size"]), num_hidden_layers=len(cfg.linear),
        num_attention_heads=int(g["num_attention_heads"]), kv_lora_rank=int(g["kv_lora_rank"]),
        q_lora_rank=int(g["q_lora_rank"]), qk_nope_head_dim=int(g["qk_nope_head_dim"]), qk_rope_head_dim=0,
        v_head_dim=int(g["v_head_dim"]), max_position_embeddings=int(g.get("max_position_embeddings") or 1048576),
        rms_norm_eps=float(g["rms_norm_eps"]), tie_word_embeddings=False, bos_token_id=g.get("bos_token_id"),
        eos_token_id=g.get("eos_token_id"))


def bytes_per_token(cfg: Glm5NextConfig, dtype_bytes: int) -> int:
    """What a sequence keeps per token: every MLA layer's latent row and, where it has its own indexer, the
    indexer's key and pool gate score."""
    mla = [i for i, lin in enumerate(cfg.linear) if not lin]
    own = sum(not cfg.shared[i] for i in mla)
    return (len(mla) * int(cfg.kv_lora_rank) + own * 2 * int(cfg.index_head_dim)) * dtype_bytes


class Glm5NextWorker(V4Worker):
    """The ``Worker`` of a ``glm5_next`` checkpoint (the module's docstring): same start-up calls, same steps."""

    def __init__(self, config: EngineConfig, par: ParallelContext = SINGLE_RANK) -> None:
        check_v4_settings(config, "glm5_next", DOC)
        raw = self._open(config, par)
        self.glm_config = Glm5NextConfig.from_raw(raw)
        text = raw.get("text_config") or raw
        cfg = self._settle(model_config(self.glm_config), text.get("dtype") or raw.get("dtype"))
        self.bytes_per_token = self.bytes_per_token_per_rank = bytes_per_token(self.glm_config, self.dtype.itemsize)
        self.state_bytes_per_sequence = StateCache(self.glm_config.linear_attention(), 1, "meta").bytes_per_slot
        self.state_bytes = self.state_bytes_per_sequence * config.max_num_seqs
        self.num_state_snapshots = self._num_state_snapshots()
        self.state_snapshot_bytes = self.state_bytes_per_sequence * self.num_state_snapshots
        self._size_streams(cfg, lambda: Glm5NextForCausalLM(self.glm_config, self.dtype), int(self.glm_config.hc_mult))
        self._unloaded()

    def _load_model(self) -> torch.nn.Module:
        return load_glm5_next(self.model_path, self.dtype)

    def _new_states(self) -> Glm5NextStateCache:
        return Glm5NextStateCache(self.own_model, self.config.max_num_seqs, self.num_state_snapshots)

    def _allocation_line(self, num_blocks: int) -> str:
        snapshots = f"{self.num_state_snapshots} state snapshots" if self.prefix_caching else "off"
        return (f"glm5_next: {self.config.max_num_seqs} state slots of {self.state_bytes_per_sequence / 2**10:.1f} KiB "
                f"(the linear layers' states) plus {self.bytes_per_token} B per token (latents, indexer keys; "
                f"{num_blocks} blocks of {self.config.block_size} tokens); prefix caching: {snapshots}")

    @property
    def prefix_caching(self) -> bool:
        """As configured, with state snapshots (a cached prefix resumes from its linear layers' states at its end)."""
        return self.config.enable_prefix_caching and self.num_state_snapshots > 0

    def check_prompt(self, ids: list[int]) -> None:
        """Refuse a prompt holding an image or video placeholder token: only the text model is served."""
        media = sorted(set(ids) & self.glm_config.media_tokens)
        if media:
            raise InvalidParam("prompt", f"the prompt holds image/video placeholder tokens {media}: glm5_next's "
                               f"vision tower is not served (text prompts only; {DOC})")


__all__ = ["Glm5NextWorker", "bytes_per_token", "model_config"]
