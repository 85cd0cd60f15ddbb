"""The one-way import rule: server → engine → worker → model → layers → attention → kernels (docs/structures.md).

Every module of ``mla_runtime`` and ``mla_kernels`` has a level; a module may import its own level and the
levels below, never one above (imports inside functions count too). Tools (the CLI, the sweep, the benchmark)
sit on top and may import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# level of each top-level name under mla_runtime (engine.worker/engine.config: see LEVEL_OF_SUBMODULE)
LEVELS = {
    "config": 1, "dtypes": 1, "errors": 1, "parallel": 1, "forward_batch": 1, "sampling_params": 1, "outputs": 1,
    "env": 1, "options": 1, "host_heap": 1,
    "hub": 1, "tokenizer": 1, "cache": 1, "help_format": 1, "checksums": 1, "resolved_config": 1, "families": 1,
    "kernel_plan": 1, "gguf_meta": 1, "gguf_file": 1, "v4_chat": 1,
    "attention": 2,  # the backends take tensors and a layer id: they never import the layer modules above them
    "layers": 3,
    "models": 4,
    "loader": 5, "latent_rank": 5, "plan": 5, "footprint": 5, "load_check": 5, "plan_cli": 5, "token_map": 5,
    "compressed": 5, "stored_int4": 5, "random_checkpoint": 5, "gguf_reader": 5, "v4_plan": 5, "row_plan": 5,
    "engine": 7, "llm": 7,
    "serving": 9,
    "cli": 10, "sweep": 10, "benchmark": 10, "warm": 10,
}
LEVEL_OF_SUBMODULE = {"engine.config": 6, "engine.worker": 6}  # the worker and its config sit below the engine
KERNELS = 0


def level(module: str) -> int:
    if module.split(".")[0] == "mla_kernels":
        return KERNELS
    name = module.removeprefix("mla_runtime.")
    if module == "mla_runtime":
        return 10  # the package's public API re-exports the top
    for prefix, lvl in LEVEL_OF_SUBMODULE.items():
        if name == prefix or name.startswith(prefix + "."):
            return lvl
    return LEVELS[name.split(".")[0]]


def modules() -> list[tuple[str, Path]]:
    found = []
    for package, folder in (("mla_runtime", ROOT / "mla_runtime"), ("mla_kernels", ROOT / "mla_kernels")):
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.append((".".join(parts), path))
    return found


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.split(".")[0] in ("mla_runtime", "mla_kernels") and n != "mla_runtime"}


@pytest.mark.parametrize("module,path", modules(), ids=lambda x: x if isinstance(x, str) else "")
def test_imports_only_point_down(module, path):
    mine = level(module)
    upward = sorted(f"{n} (level {level(n)})" for n in imported(path) if level(n) > mine)
    assert not upward, f"{module} (level {mine}) imports a higher level: {upward}"


def test_every_module_has_a_level():
    for module, _ in modules():
        level(module)  # a new top-level module must be placed in LEVELS


def test_kernels_never_import_the_runtime():
    for module, path in modules():
        if module.startswith("mla_kernels"):
            assert not any(n.startswith("mla_runtime") for n in imported(path)), module


ENV_ACCESS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _environment_access(tree: ast.AST) -> list[int]:
    """Lines of ``os.environ`` / ``os.getenv`` (and the like) and of ``from os import environ``."""
    return sorted(
        node.lineno for node in ast.walk(tree)
        if (isinstance(node, ast.Attribute) and node.attr in ENV_ACCESS and isinstance(node.value, ast.Name)
            and node.value.id == "os")
        or (isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in ENV_ACCESS for a in node.names)))


def test_only_the_env_module_reads_the_environment():
    """Every environment variable is read in ``mla_runtime/env.py``, whose docstring lists them all."""
    for module, path in modules():
        if module.startswith("mla_runtime") and module != "mla_runtime.env":
            lines = _environment_access(ast.parse(path.read_text()))
            assert not lines, f"{module} reads the environment (lines {lines}): add a function to mla_runtime/env.py"


def test_every_config_field_has_a_flag_and_a_yaml_key():
    from dataclasses import fields

    from mla_runtime.engine.config import EngineConfig
    from mla_runtime.serving.config import OPTIONS, YAML_KEYS, ReplicaConfig, ServerConfig, build_parser

    flags: dict[str, list[str]] = {}
    for action in build_parser()._actions:
        flags.setdefault(action.dest, []).extend(action.option_strings)
    for cls in (EngineConfig, ServerConfig, ReplicaConfig):
        for f in fields(cls):
            option = OPTIONS[f.name]
            assert option.flag in flags.get(f.name, []), f"{cls.__name__}.{f.name} has no flag"
            assert YAML_KEYS.get(option.yaml) == f.name, f"{cls.__name__}.{f.name} has no YAML key of its own"


def test_the_scheduler_knows_nothing_of_speculation():
    """Drafts are chosen by ``engine/proposer.py``; the scheduler only budgets a decode's extra tokens."""
    source = (ROOT / "mla_runtime" / "engine" / "scheduler.py").read_text().lower()
    found = [word for word in ("draft", "mtp", "speculative", "lookahead") if word in source]
    assert not found, f"engine/scheduler.py mentions {found}"


def _class_node(path: Path, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == name)


def test_the_attention_layer_leaves_paths_to_its_backend():
    """``MLAttention`` keeps the projections and hands the rest to the step's attention backend: it stays short and
    never tests a dtype or a device (the backends in ``mla_runtime/attention/`` decide their own paths)."""
    node = _class_node(ROOT / "mla_runtime" / "layers" / "mla.py", "MLAttention")
    assert node.end_lineno is not None and node.end_lineno - node.lineno + 1 < 80
    tests = [n.lineno for n in ast.walk(node) if isinstance(n, ast.Compare)
             and any(isinstance(x, ast.Attribute) and x.attr in ("dtype", "device", "type")
                     for side in (n.left, *n.comparators) for x in ast.walk(side))]
    assert not tests, f"MLAttention tests a dtype or device on lines {tests}"


MAX_FUNCTION_LINES = 60


def test_no_function_is_longer_than_a_screen():
    """Every function and method of ``mla_runtime`` fits in ``MAX_FUNCTION_LINES`` lines, docstring included."""
    long = []
    for module, path in modules():
        if not module.startswith("mla_runtime"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert not long, long


def test_the_front_door_and_the_engine_stay_short():
    """The README reads in a few minutes, and the engine's step loop in one file of under 200 lines (scheduling,
    running and request processing live in their own modules)."""
    assert len((ROOT / "README.md").read_text().splitlines()) < 150
    assert len((ROOT / "mla_runtime" / "engine" / "llm_engine.py").read_text().splitlines()) < 200
