"""``ResolvedConfig``: what the engine's settings mean on this machine, decided once and handed whole to the model.

``EngineConfig`` says what the user asked for (``dtype="auto"``, no device, no attention backend); the ``Worker``
resolves it against the checkpoint and the machine (``engine/worker.py``) and ``loader.load_model`` does the same for
a model loaded on its own. Every layer then reads the one frozen object it was built with: the model's shape, the
weight dtype and device, this rank's place under tensor parallelism and the attention backend (``attention``). The
Worker's record also holds what it sized (the cache dtype and block, ``max_model_len`` and the step's budgets) and
its kernel plan (``kernel_plan.KernelPlan``: on a CPU, the probed product paths under the ``cpu_gemm`` setting).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_runtime.config import ModelConfig
from mla_runtime.dtypes import CacheDtype
from mla_runtime.kernel_plan import OFF_CPU, CpuLayouts, KernelPlan
from mla_runtime.options import ATTENTION_PATHS
from mla_runtime.parallel import SINGLE_RANK, ParallelContext


@dataclass(frozen=True)
class ResolvedConfig:
    model: ModelConfig  # the checkpoint's shape (a truncated latent rank is folded in after the load)
    dtype: torch.dtype = torch.float32  # weights and activations
    device: torch.device = torch.device("cpu")
    par: ParallelContext = SINGLE_RANK
    attention_backend: str = "cpu"  # a name of ``attention.BACKENDS``, chosen for the device (``attention.resolve``)
    attention_path: str = "auto"  # "auto" (by FLOP count per step), "naive" or "absorbed"
    num_mtp_layers: int = 0  # DeepSeek-V3's multi-token-prediction layers built after the decoder's
    quantization: str | None = None  # the products' weight format (None: ``dtype``)
    # the engine's (a model loaded on its own has none): the latent cache's element type and block, the lengths and
    # budgets of a step
    cache_dtype: CacheDtype | None = None
    block_size: int = 64
    max_model_len: int = 0
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    # what computes the products (``kernel_plan``): a CPU's probed paths under the engine's cpu_gemm setting, or
    # OFF_CPU on another device; every weight is prepared against it
    plan: KernelPlan = OFF_CPU
    # whether every part gives a row the same bits whatever rows share its call (BATCH_INVARIANT_MODES; the model's
    # rows_invariant)
    batch_invariant: str = "auto"

    @property
    def cpu(self) -> CpuLayouts | None:
        """The planner's facts about the plan's layouts for this model's weights (None off a CPU)."""
        return None if self.plan is OFF_CPU else self.plan.layouts(self.dtype)

    def __post_init__(self) -> None:
        if self.attention_path not in ATTENTION_PATHS:
            raise ValueError(f"attention_path must be one of {ATTENTION_PATHS}, got {self.attention_path!r}")
        if self.num_mtp_layers < 0:
            raise ValueError(f"num_mtp_layers must be >= 0, got {self.num_mtp_layers}")
