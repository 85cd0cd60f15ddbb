"""The settings' vocabulary, importable without torch: option metadata, accepted values, byte sizes.

Each field of ``EngineConfig``, ``ServerConfig`` and ``ReplicaConfig`` declares its YAML key, flag and help in
its ``metadata`` (``opt``). ``serving/config.py`` builds the command line, the serve.yaml loader and the error
locations from them, so a new setting is one field in one file. ``mla-runtime serve --help`` builds the parser
from this module and the config classes alone, which is why nothing here (or there) may import torch.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields, replace
from decimal import Decimal, InvalidOperation
from typing import Any, Union, get_args, get_origin, get_type_hints

from mla_runtime.errors import InvalidParam

# the values the engine accepts; the modules that act on them (layers, dtypes, plan) check against the same
ATTENTION_PATHS = ("auto", "naive", "absorbed")
LATENT_CACHE_LAYOUTS = ("replicated", "sharded")
# the CPU products (layers/cpu_gemm.py): auto, the fast paths where their probes pass; onednn, oneDNN without the
# compiled kernels; plain, the fallbacks only
CPU_GEMM_MODES = ("auto", "onednn", "plain")
# whether a row's bits may depend on the rows sharing its steps (models/deepseek.py, rows_invariant): auto, not where
# the products round their rows to int8 (int4, W4A16, W8A8, GGUF); on, not for any weights; off, the fast paths
BATCH_INVARIANT_MODES = ("auto", "on", "off")
# a CPU engine's heap (host_heap.py): retain, freed activations stay mapped for the next step; system, the C
# library's defaults
CPU_HEAP_MODES = ("retain", "system")
# the formats of layers.quantization.WEIGHT_FORMATS
WEIGHT_QUANTIZATIONS = ("int8", "int4", "w4a16", "fp8", "bf16", "fp16", "w8a8", "mxfp4", "nvfp4")
# the names of dtypes.CACHE_DTYPES (which maps them to torch dtypes)
CACHE_DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "fp8", "fp8_e4m3", "int8")
# how decode steps use CUDA graphs (engine/cuda_graphs.py): capture them on CUDA, or run them eagerly through the
# graphs' padded buffers on any device (the stand-in, no capture)
CUDA_GRAPH_MODES = ("capture", "stand-in")

OPTION = "option"  # the metadata key of a config field's ``Option``


@dataclass(frozen=True)
class Option:
    """Where a config field is set. Declared with ``opt``; ``options_of`` fills in the rest from the field."""

    yaml: str  # "section.key" in serve.yaml
    help: str
    flag: str = ""  # empty: "--" + the field name with dashes
    parse: Callable[[str], Any] | None = None  # the flag's text → value (None: the field's type)
    choices: tuple[Any, ...] = ()  # listed in --help; the config class validates
    name: str = ""  # the field
    kinds: tuple[type, ...] = ()  # the types a YAML value may have
    default: Any = None


def opt(yaml: str, help: str, *, flag: str = "", parse: Callable[[str], Any] | None = None,
        choices: tuple[Any, ...] = ()) -> dict[str, Option]:
    """A field's ``metadata``: ``field(default=64, metadata=opt("kv_cache.block_size", "tokens per block"))``."""
    return {OPTION: Option(yaml, help, flag, parse, choices)}


def options_of(cls: type) -> dict[str, Option]:
    """Field name → its completed ``Option``, in field order; a field without one is a ``TypeError``."""
    hints = get_type_hints(cls)
    out: dict[str, Option] = {}
    for f in fields(cls):
        declared = f.metadata.get(OPTION)
        if declared is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no option metadata (opt(...)): no flag or YAML key")
        hint = hints[f.name]
        union = get_origin(hint) in (Union, types.UnionType)
        kinds = tuple(a for a in get_args(hint) if a is not type(None)) if union else (hint,)
        kinds = tuple(get_origin(k) or k for k in kinds)  # list[int] → list: what a YAML value is checked against
        if len(kinds) > 1 and str not in kinds and declared.parse is None:
            raise TypeError(f"{cls.__name__}.{f.name}: a union type needs parse= for its flag")
        out[f.name] = replace(declared, name=f.name, flag=declared.flag or "--" + f.name.replace("_", "-"),
                              kinds=kinds, default=None if f.default is MISSING else f.default)
    return out


def flag_type(option: Option) -> Callable[[str], Any]:
    """The flag's parse function: declared, or the field's one type; a string for unions with ``str`` (such as
    "8GiB" or a byte count), which the config class parses and reports."""
    if option.parse is not None:
        return option.parse
    return option.kinds[0] if len(option.kinds) == 1 else str


def yaml_kinds(option: Option) -> tuple[type, ...]:
    """The YAML types accepted (an int where a float is expected, never a bool where it is not)."""
    return (*option.kinds, int) if float in option.kinds and int not in option.kinds else option.kinds


def check_quantization(value: object) -> str | None:
    """The normalised ``quantization`` setting (None: off); anything else is ``InvalidParam('quantization')``."""
    if value is None or value == "none":
        return None
    if not isinstance(value, str) or value not in WEIGHT_QUANTIZATIONS:
        raise InvalidParam("quantization", f"quantization must be one of none, {', '.join(WEIGHT_QUANTIZATIONS)}, "
                                           f"got {value!r}")
    return value


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: str | int) -> int:
    """``"80GiB"``, ``"2GB"``, ``"512MiB"``, ``"1.5e9"`` or an int → bytes.

    kB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024; units are case-insensitive.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"byte size must be an int or a string like '80GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte size must be >= 0, got {value}")
        return value
    match = _BYTES_RE.match(value)
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise ValueError(f"cannot parse byte size {value!r}: use a number with an optional unit "
                         f"B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as e:  # pragma: no cover - the regex admits only valid decimals
        raise ValueError(f"cannot parse byte size {value!r}") from e
    return int(number * unit)
