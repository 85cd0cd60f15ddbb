"""``ResolvedConfig``: what the engine's settings mean on this machine, decided once and handed whole to the model.

``EngineConfig`` says what the user asked for (``dtype="auto"``, no device, no attention backend); the ``Worker``
resolves it against the checkpoint and the machine (``engine/worker.py``) and ``loader.load_model`` does the same for
a model loaded on its own. Every layer then reads the one frozen object it was built with: the model's shape, the
weight dtype and device, this rank's place under tensor parallelism and the attention backend (``attention``). The
Worker's record also holds what it sized (the cache dtype and block, ``max_model_len`` and the step's budgets) and,
on a CPU, its kernel plan (the ``cpu_gemm`` mode and the probes' ``CpuLayouts``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mla_runtime.config import ModelConfig
from mla_runtime.dtypes import CacheDtype
from mla_runtime.options import ATTENTION_PATHS
from mla_runtime.parallel import SINGLE_RANK, ParallelContext


@dataclass(frozen=True)
class CpuLayouts:
    """What this CPU's product paths hold beside a model's ``dtype`` weights, as its load-time probes found them
    (``layers.cpu_gemm.cpu_layouts``): the facts about the machine that the memory planner's arithmetic counts."""

    dtype: torch.dtype  # the model dtype these facts are for
    extra_bytes_per_element: int  # each float matrix's second layout (oneDNN's blocked copy, or a float32 copy)
    row_kernels: bool  # the compiled few-row kernels run (they read float32 copies of int8 scales)
    bf16_blocked: bool = False  # bf16 weights keep oneDNN's blocked bfloat16 copy for many-row products (layers.bf16)
    # each matrix in one layout: oneDNN's blocked copies and AMX's tiles left out (``cpu_gemm.one_layout``), where the
    # load would not fit the machine with them
    one_layout: bool = False

    def with_one_layout(self) -> CpuLayouts | None:
        """These facts with the second layouts of the ``onednn`` path left out (an ``upcast`` path's float32 copy, which
        the products need, stays), or None where that leaves nothing out: the one place that says whether a load can
        shed them (the engine's load check and the planner ask it)."""
        onednn = self.extra_bytes_per_element == self.dtype.itemsize
        if self.one_layout or not (onednn or self.bf16_blocked):
            return None
        return dataclasses.replace(self, extra_bytes_per_element=0 if onednn else self.extra_bytes_per_element,
                                   bf16_blocked=False, one_layout=True)


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
    # the kernel plan of a CPU: the cpu_gemm mode the weights were prepared under, and what its probes found
    cpu_gemm: str | None = None
    cpu: CpuLayouts | None = None

    def __post_init__(self) -> None:
        if self.attention_path not in ATTENTION_PATHS:
            raise ValueError(f"attention_path must be one of {ATTENTION_PATHS}, got {self.attention_path!r}")
        if self.num_mtp_layers < 0:
            raise ValueError(f"num_mtp_layers must be >= 0, got {self.num_mtp_layers}")
