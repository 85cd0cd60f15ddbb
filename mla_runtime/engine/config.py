"""``EngineConfig``: every knob of ``LLM``/``AsyncLLM``, validated once, frozen.

Imports nothing that imports torch: ``mla-runtime serve --help`` builds its parser from these fields.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from mla_runtime.errors import InvalidParam
from mla_runtime.options import (
    ATTENTION_PATHS,
    BATCH_INVARIANT_MODES,
    CACHE_DTYPE_NAMES,
    CPU_GEMM_MODES,
    CPU_HEAP_MODES,
    CUDA_GRAPH_MODES,
    LATENT_CACHE_LAYOUTS,
    WEIGHT_QUANTIZATIONS,
    check_quantization,
    opt,
    parse_bytes,
)

ATTENTION_BACKENDS = (None, "triton", "torch", "cpu")  # the names of mla_runtime.attention.BACKENDS
SPECULATIVE_METHODS = ("prompt_lookup", "mtp")
LATENT_PROJECTIONS = ("svd", "pca")


def parse_threads(text: str) -> int | str:
    """``--num-threads``: a count or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or 'auto', got {text!r}") from None


def parse_sizes(text: str) -> tuple[int, ...]:
    """``--cuda-graph-sizes``: batch sizes separated by commas (or spaces), e.g. ``1,2,4,8``."""
    try:
        return tuple(int(s) for s in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch sizes like 1,2,4,8, got {text!r}") from None


@dataclass(frozen=True)
class EngineConfig:
    """Each field's ``opt`` gives its serve.yaml key, flag and help: ``serving/config.py`` builds the command
    line and the YAML loader from them."""

    # a checkpoint folder, a GGUF model (gguf_meta.gguf_files) or a hub repo id (org/name: hub.resolve_model)
    model: str = field(metadata=opt("model.path", "checkpoint directory, GGUF file, or hub repo id org/name "
                                                  "(default: the embedded demo model)"))
    revision: str | None = field(default=None, metadata=opt(
        "model.revision", "hub branch, tag or commit of a repo id --model (default: main)"))
    dtype: str = field(default="auto", metadata=opt(
        "model.dtype", "weight/compute dtype: auto (the checkpoint's), bfloat16, float16, float32"))
    # weight-only quantisation at load (layers/quantization.py): None / "none" (the dtype's weights) or a format
    quantization: str | None = field(default=None, metadata=opt(
        "model.quantization", "weight-only quantisation at load (default: the checkpoint's weights in --dtype)",
        choices=("none", *WEIGHT_QUANTIZATIONS)))
    max_model_len: int | None = field(default=None, metadata=opt(
        "kv_cache.max_seq_len", "context limit per request (default: the model's max_position_embeddings)"))
    block_size: int = field(default=64, metadata=opt(
        "kv_cache.block_size", "tokens per cache block (multiple of 16)"))
    kv_cache_dtype: str = field(default="auto", metadata=opt(
        "kv_cache.dtype", "latent-cache element type (auto: the model's dtype; a half-precision checkpoint's own "
                          "where dtype auto computes it in float32 over its half weights)", choices=CACHE_DTYPE_NAMES))
    kv_cache_memory: int | str | None = field(default=None, metadata=opt(
        "kv_cache.memory", "latent-cache bytes, e.g. 8GiB (default: on CPU a quarter of the available RAM, at most "
                           "max-num-seqs full sequences; on GPU 90% of free memory less weights and activations)"))
    max_num_seqs: int = field(default=64, metadata=opt("kv_cache.max_num_seqs", "sequences running at once"))
    max_num_batched_tokens: int | None = field(default=None, metadata=opt(
        "kv_cache.max_num_batched_tokens", "token budget of one step (default: max-model-len capped at 8192, "
                                           "at least 2048)"))
    enable_prefix_caching: bool = field(default=True, metadata=opt(
        "kv_cache.prefix_caching", "keep the blocks of finished prompts so that later prompts with the same "
                                   "prefix skip its prefill"))
    # a hybrid model's prefix caching keeps its linear layers' states at cached prefixes' ends (cache/state_cache.py)
    state_snapshot_memory: int | str | None = field(default=None, metadata=opt(
        "kv_cache.state_snapshot_memory", "bytes of a hybrid model's state snapshots, the linear-attention states "
                                          "(DeepSeek-V4: the whole state) at the end of cached prefixes, e.g. 2GiB; "
                                          "0: no prefix caching for such a model (default: as many snapshots as "
                                          "max-num-seqs, for V4 of 8192-token prefixes)"))
    # between steps, idle cached prefix blocks are freed (LRU first) while more than this fraction of the
    # latent-cache blocks is in use or cached (1.0: only when an allocation needs them)
    cache_watermark: float = field(default=0.8, metadata=opt(
        "kv_cache.watermark", "fraction of latent-cache blocks (in use or cached) above which idle cached prefix "
                              "blocks are freed between steps, least recently used first (1.0: off)"))
    verify_weights: bool = field(default=False, metadata=opt(
        "model.verify_weights", "check every *.safetensors file against the checkpoint's sha256 manifest (the "
                                "hub's LFS hashes, or SHA256SUMS from 'mla-runtime hash') before loading"))
    tensor_parallel_size: int = field(default=1, metadata=opt(
        "model.tensor_parallel_size", "ranks the model is sharded across (torchrun or worker processes)"))
    attention_backend: str | None = field(default=None, metadata=opt(
        "model.attention_backend", "attention kernels (default: by device)", choices=ATTENTION_BACKENDS[1:]))
    attention_path: str = field(default="auto", metadata=opt(
        "model.attention_path", "attend over up-projected keys and values (naive), in the latent space "
                                "(absorbed), or the cheaper of the two per step by FLOP count (auto)",
        choices=ATTENTION_PATHS))
    latent_cache_layout: str = field(default="replicated", metadata=opt(
        "kv_cache.layout", "the latent cache across tensor-parallel ranks", choices=LATENT_CACHE_LAYOUTS))
    latent_rank: int | None = field(default=None, metadata=opt(
        "model.latent_rank", "truncate the cached latent to this rank (default: the model's kv_lora_rank)"))
    latent_projection: str = field(default="svd", metadata=opt(
        "model.latent_projection", "basis of --latent-rank: svd (of the weights, no data) or pca (of the latents "
                                   "of --latent-calibration)", choices=LATENT_PROJECTIONS))
    latent_calibration: str | None = field(default=None, metadata=opt(
        "model.latent_calibration", "text file whose latents --latent-projection pca is fitted to "
                                    "(default: no file)"))
    seed: int = field(default=0, metadata=opt("engine.seed", "seed of the sampling random number generator"))
    device: str | None = field(default=None, metadata=opt(
        "engine.device", "torch device, e.g. cpu, cuda, cuda:1 (default: cuda when available and "
                         "--tensor-parallel-size is 1, else cpu)"))
    # CPU threads of the model's kernels: a count, "auto" (measured per step size, see engine/thread_tuner.py)
    # or None (torch's setting: every core)
    num_threads: int | str | None = field(default=None, metadata=opt(
        "engine.num_threads", "CPU threads of the model's kernels: a count, or auto (tuned per step size) "
                              "(default: torch's setting, every core)", parse=parse_threads))
    # the CPU products' paths, chosen once when the model is prepared (layers/cpu_gemm.py): auto, the fast paths where
    # their probes pass; onednn, oneDNN without the compiled kernels; plain, the fallbacks only
    cpu_gemm: str | None = field(default=None, metadata=opt(
        "engine.cpu_gemm", "CPU products: auto (the fast paths where their probes pass), onednn (oneDNN without the "
                           "compiled kernels) or plain (the fallbacks) (default: auto)", choices=CPU_GEMM_MODES))
    # whether a prompt's answer may depend on what shares its steps (BATCH_INVARIANT_MODES; models/deepseek.py,
    # rows_invariant): auto, never where the products round their rows to int8
    batch_invariant: str = field(default="auto", metadata=opt(
        "engine.batch_invariant", "a prompt's tokens independent of the batch: auto (where the products round their "
                                  "rows to int8: int4, W4A16, W8A8, GGUF), on (any weights, some speed given up) or "
                                  "off (the fastest paths) (default: auto)", choices=BATCH_INVARIANT_MODES))
    # a CPU engine's heap (host_heap.py): retain, freed activations stay mapped for the next step (glibc);
    # system, the C library's defaults
    cpu_heap: str = field(default="retain", metadata=opt(
        "engine.cpu_heap", "CPU heap: retain (freed activations stay mapped for the next step, up to the activation "
                           "reserve; glibc) or system (the C library's defaults)", choices=CPU_HEAP_MODES))
    # speculative decoding: up to this many draft tokens per step (0: off), by prompt lookup (engine/speculative.py:
    # copied after the latest earlier occurrence of the sequence's last prompt_lookup_max .. prompt_lookup_min
    # tokens) or by the checkpoint's multi-token-prediction layer ("mtp", engine/mtp.py; 1 draft when
    # num_speculative_tokens is left at 0)
    speculative_method: str = field(default="prompt_lookup", metadata=opt(
        "speculative.method", "where drafts come from: prompt_lookup, or mtp (the checkpoint's "
                              "multi-token-prediction layer)", choices=SPECULATIVE_METHODS))
    num_speculative_tokens: int = field(default=0, metadata=opt(
        "speculative.num_tokens", "draft tokens per decode step (0: off; mtp alone: 1)"))
    prompt_lookup_max: int = field(default=3, metadata=opt(
        "speculative.prompt_lookup_max", "longest suffix looked up for drafts"))
    prompt_lookup_min: int = field(default=1, metadata=opt(
        "speculative.prompt_lookup_min", "shortest suffix looked up for drafts"))
    # the tokens MTP drafts may propose (token_map.py): None: the checkpoint's speculative_token_map.json where it
    # has one, else all; "none": all; a path: that JSON list of token ids
    speculative_token_map: str | None = field(default=None, metadata=opt(
        "speculative.token_map", "JSON list of the token ids MTP drafts may propose, or 'none': all (default: "
                                 "the checkpoint's speculative_token_map.json, else all)"))
    # the disk tier of the prefix cache (cache/disk_tier.py): full blocks evicted from the pool (or, with
    # write-through, every full block) are written under kv_cache_dir and found there again after a restart
    kv_cache_dir: str | None = field(default=None, metadata=opt(
        "kv_cache.dir", "directory of the disk tier: evicted prefix-cache blocks are written there and found "
                        "again after a restart; several processes may share it (default: off)"))
    kv_cache_write_through: bool = field(default=False, metadata=opt(
        "kv_cache.write_through", "write every full block to the disk tier as soon as it is complete"))
    kv_cache_disk_bytes: int | str | None = field(default=None, metadata=opt(
        "kv_cache.disk_bytes", "bound of the disk tier's directory, e.g. 500GiB; least recently used files go "
                               "first (default: its current size plus 90% of the free disk space)"))
    # the host-RAM tier between the device pool and the disk tier (cache/host_tier.py; useful on GPUs); on a CPU
    # the pool is host RAM already. It needs enable_prefix_caching, not kv_cache_dir
    kv_cache_host_bytes: int | str | None = field(default=None, metadata=opt(
        "kv_cache.host_bytes", "host RAM for the host tier between the GPU's cache and the disk tier, e.g. "
                               "64GiB; 0: none (default: on CUDA a quarter of the available RAM, on a CPU none)"))
    # decode steps under CUDA graphs (engine/cuda_graphs.py): a step of one new token per sequence replays the graph
    # of the smallest size that holds it, padded; other steps, and larger ones, run eagerly
    enforce_eager: bool = field(default=False, metadata=opt(
        "engine.enforce_eager", "run every step eagerly: no CUDA graphs"))
    cuda_graph_sizes: tuple[int, ...] | list[int] | None = field(default=None, metadata=opt(
        "engine.cuda_graph_sizes", "batch sizes of the decode steps captured as CUDA graphs, e.g. 1,2,4,8 (default: "
                                   "1, 2, 4 and the multiples of 8 up to the first that holds --max-num-seqs, at most "
                                   "512)", parse=parse_sizes))
    cuda_graph_mode: str = field(default="capture", metadata=opt(
        "engine.cuda_graph_mode", "capture: decode steps replay CUDA graphs on CUDA (none elsewhere); stand-in: they "
                                  "run eagerly through the graphs' padded buffers, no capture, on any device (a check "
                                  "that padding changes no output)", choices=CUDA_GRAPH_MODES))

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantization", check_quantization(self.quantization))
        if self.block_size < 16 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")
        if self.kv_cache_dtype not in CACHE_DTYPE_NAMES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(CACHE_DTYPE_NAMES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
        if self.state_snapshot_memory is not None:
            object.__setattr__(self, "state_snapshot_memory", parse_bytes(self.state_snapshot_memory))
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be 'triton', 'torch', 'cpu' or None, "
                             f"got {self.attention_backend!r}")
        if self.attention_path not in ATTENTION_PATHS:
            raise ValueError(f"attention_path must be one of {ATTENTION_PATHS}, got {self.attention_path!r}")
        if self.latent_cache_layout not in LATENT_CACHE_LAYOUTS:
            raise ValueError(f"latent_cache_layout must be one of {LATENT_CACHE_LAYOUTS}, "
                             f"got {self.latent_cache_layout!r}")
        self._check_speculation()
        if self.latent_projection not in LATENT_PROJECTIONS:
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
        if self.cpu_heap not in CPU_HEAP_MODES:
            raise InvalidParam("cpu_heap", f"cpu_heap must be one of {', '.join(CPU_HEAP_MODES)}, "
                               f"got {self.cpu_heap!r}")
        if self.batch_invariant not in BATCH_INVARIANT_MODES:
            raise InvalidParam("batch_invariant", f"batch_invariant must be one of {', '.join(BATCH_INVARIANT_MODES)}, "
                               f"got {self.batch_invariant!r}")
        if self.cpu_gemm is not None and self.cpu_gemm not in CPU_GEMM_MODES:
            raise InvalidParam("cpu_gemm", f"cpu_gemm must be one of {', '.join(CPU_GEMM_MODES)} or None, "
                               f"got {self.cpu_gemm!r}")
        self._check_cuda_graphs()
        if self.num_threads is not None and self.num_threads != "auto" and (
                not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be a positive int, 'auto' or None, got {self.num_threads!r}")

    def _check_speculation(self) -> None:
        """The speculative decoding settings (``mtp`` drafts at least one token)."""
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

    def _check_cuda_graphs(self) -> None:
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.cuda_graph_mode not in CUDA_GRAPH_MODES:
            raise InvalidParam("cuda_graph_mode", f"cuda_graph_mode must be one of {', '.join(CUDA_GRAPH_MODES)}, "
                               f"got {self.cuda_graph_mode!r}")
        sizes = self.cuda_graph_sizes
        if sizes is None:
            return
        if not isinstance(sizes, (tuple, list)) or not sizes or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes):
            raise InvalidParam("cuda_graph_sizes", f"cuda_graph_sizes must be a non-empty list of batch sizes >= 1, "
                               f"got {sizes!r}")
        object.__setattr__(self, "cuda_graph_sizes", tuple(sorted(set(sizes))))

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
