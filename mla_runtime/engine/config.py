"""``EngineConfig``: every knob of ``LLM``/``AsyncLLM``, validated once, frozen."""

from __future__ import annotations

import os
from dataclasses import dataclass

from mla_runtime.dtypes import CACHE_DTYPES
from mla_runtime.errors import InvalidParam
from mla_runtime.layers.mla import ATTENTION_PATHS
from mla_runtime.layers.quantization import check_quantization
from mla_runtime.plan import LATENT_CACHE_LAYOUTS, parse_bytes

ATTENTION_BACKENDS = (None, "triton", "torch")
SPECULATIVE_METHODS = ("prompt_lookup", "mtp")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a checkpoint folder or a hub repo id (org/name, resolved by hub.resolve_model)
    revision: str | None = None  # hub branch, tag or commit of a repo id (None: main)
    dtype: str = "auto"
    # weight-only quantisation at load (layers/quantization.py): None / "none" (the dtype's weights) or "int8"
    quantization: str | None = None
    max_model_len: int | None = None
    block_size: int = 64
    kv_cache_dtype: str = "auto"
    kv_cache_memory: int | str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    # between steps, idle cached prefix blocks are freed (LRU first) while more than this fraction of the
    # latent-cache blocks is in use or cached (1.0: only when an allocation needs them)
    cache_watermark: float = 0.8
    verify_weights: bool = False  # check every *.safetensors against the checkpoint's sha256 manifest first
    tensor_parallel_size: int = 1
    attention_backend: str | None = None
    attention_path: str = "auto"
    latent_cache_layout: str = "replicated"
    latent_rank: int | None = None
    latent_projection: str = "svd"  # "svd" (no data) or "pca" (needs latent_calibration)
    latent_calibration: str | None = None  # a text file for the PCA of the latents
    seed: int = 0
    device: str | None = None
    # CPU threads of the model's kernels: a count, "auto" (measured per step size, see engine/thread_tuner.py)
    # or None (torch's setting: every core)
    num_threads: int | str | None = None
    # speculative decoding: up to this many draft tokens per step (0: off), by prompt lookup (engine/speculative.py:
    # copied after the latest earlier occurrence of the sequence's last prompt_lookup_max .. prompt_lookup_min
    # tokens) or by the checkpoint's multi-token-prediction layer ("mtp", engine/mtp.py; 1 draft when
    # num_speculative_tokens is left at 0)
    speculative_method: str = "prompt_lookup"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    # the tokens MTP drafts may propose (token_map.py): None: the checkpoint's speculative_token_map.json where it
    # has one, else all; "none": all; a path: that JSON list of token ids
    speculative_token_map: str | None = None
    # the disk tier of the prefix cache (cache/disk_tier.py): full blocks evicted from the pool (or, with
    # write-through, every full block) are written under kv_cache_dir and found there again after a restart;
    # kv_cache_disk_bytes bounds the directory (default: its current size plus 90% of the free disk space)
    kv_cache_dir: str | None = None
    kv_cache_write_through: bool = False
    kv_cache_disk_bytes: int | str | None = None
    # the host-RAM tier between the device pool and the disk tier (cache/host_tier.py; useful on GPUs): bytes of
    # host memory for evicted blocks (0: none). None: a quarter of the available RAM on CUDA, none on a CPU (whose
    # pool is host RAM already). It needs enable_prefix_caching, not kv_cache_dir
    kv_cache_host_bytes: int | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantization", check_quantization(self.quantization))
        if self.block_size < 16 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")
        if self.kv_cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be 'triton', 'torch' or None, got {self.attention_backend!r}")
        if self.attention_path not in ATTENTION_PATHS:
            raise ValueError(f"attention_path must be one of {ATTENTION_PATHS}, got {self.attention_path!r}")
        if self.latent_cache_layout not in LATENT_CACHE_LAYOUTS:
            raise ValueError(f"latent_cache_layout must be one of {LATENT_CACHE_LAYOUTS}, "
                             f"got {self.latent_cache_layout!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise InvalidParam("speculative_method", f"speculative_method must be one of {SPECULATIVE_METHODS}, "
                               f"got {self.speculative_method!r}")
        if self.speculative_method == "mtp" and self.num_speculative_tokens == 0:
            object.__setattr__(self, "num_speculative_tokens", 1)
        if isinstance(self.speculative_token_map, os.PathLike):
            object.__setattr__(self, "speculative_token_map", os.fspath(self.speculative_token_map))
        if self.speculative_token_map is not None and not isinstance(self.speculative_token_map, str):
            raise InvalidParam("speculative_token_map", "speculative_token_map must be a path, 'none' or None, "
                               f"got {self.speculative_token_map!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) and prompt_lookup_max "
                             f"({self.prompt_lookup_max}) must satisfy 1 <= min <= max")
        if self.latent_projection not in ("svd", "pca"):
            raise ValueError(f"latent_projection must be 'svd' or 'pca', got {self.latent_projection!r}")
        if self.latent_projection == "pca" and self.latent_rank is not None and not self.latent_calibration:
            raise ValueError("latent_projection 'pca' needs latent_calibration (a text file)")
        if isinstance(self.cache_watermark, bool) or not isinstance(self.cache_watermark, (int, float)) or \
                not 0.0 < self.cache_watermark <= 1.0:
            raise ValueError(f"cache_watermark must be a fraction in (0, 1], got {self.cache_watermark!r}")
        if not isinstance(self.verify_weights, bool):
            raise ValueError(f"verify_weights must be true or false, got {self.verify_weights!r}")
        self._check_disk_tier()
        self._check_host_tier()
        if self.num_threads is not None and self.num_threads != "auto" and (
                not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be a positive int, 'auto' or None, got {self.num_threads!r}")

    def _check_disk_tier(self) -> None:
        if isinstance(self.kv_cache_dir, os.PathLike):
            object.__setattr__(self, "kv_cache_dir", os.fspath(self.kv_cache_dir))
        if self.kv_cache_disk_bytes is not None:
            object.__setattr__(self, "kv_cache_disk_bytes", parse_bytes(self.kv_cache_disk_bytes))
        if self.kv_cache_dir is None:
            for name in ("kv_cache_write_through", "kv_cache_disk_bytes"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(f"{name} needs kv_cache_dir (the disk tier's directory)")
            return
        if not isinstance(self.kv_cache_dir, str) or not self.kv_cache_dir:
            raise ValueError(f"kv_cache_dir must be a directory path, got {self.kv_cache_dir!r}")
        if not self.enable_prefix_caching:
            raise ValueError("kv_cache_dir needs enable_prefix_caching (the disk tier holds prefix-cache blocks)")
        if not isinstance(self.kv_cache_write_through, bool):
            raise ValueError(f"kv_cache_write_through must be true or false, got {self.kv_cache_write_through!r}")

    def _check_host_tier(self) -> None:
        if self.kv_cache_host_bytes is None:
            return
        try:
            host_bytes = parse_bytes(self.kv_cache_host_bytes)
        except ValueError as e:
            raise InvalidParam("kv_cache_host_bytes", f"kv_cache_host_bytes: {e}") from None
        object.__setattr__(self, "kv_cache_host_bytes", host_bytes)
        if host_bytes and not self.enable_prefix_caching:
            raise InvalidParam("kv_cache_host_bytes", "kv_cache_host_bytes needs enable_prefix_caching (the host "
                               "tier holds prefix-cache blocks); set it to 0 or turn prefix caching on")
