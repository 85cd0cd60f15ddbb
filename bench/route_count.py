"""Count what decides a CPU product: the routes of one linear call and the places that ask the machine or the mode.

    python bench/route_count.py                      # this tree
    python bench/route_count.py --root /tmp/before   # another checkout (git worktree add /tmp/before <commit>)

Read from the source, not run: for one linear call, the ``return`` statements of ``cpu_gemm.linear``, the float
product below it and each weight format's ``matmul`` (each is one way a product can be computed); and, across
``mla_runtime``, the call sites that consult a probe or the ``cpu_gemm`` mode while weights are prepared or run
(``cpu_kernels.failure``, ``gemm_mode``, the ``*_failure`` probes and their wrappers; a question put to a resolved
plan, ``plan.x(...)``, is not one), and the places that resolve the kernel plan (``kernel_plan(mode)``). Outside the
module that resolves the plan, a prepared weight should only read the plan it was given.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

# the functions one linear call can pass through, by file: cpu_gemm's dispatch and each format's product
# (every weight format's ``matmul`` under mla_runtime/layers, found by name, so a new format is counted too)
LINEAR_FUNCTIONS = {
    "mla_runtime/layers/cpu_gemm.py": ("linear", "matmul", "torch_product"),
    **{f"mla_runtime/layers/{p.name}": ("matmul",)
       for p in sorted((Path(__file__).resolve().parent.parent / "mla_runtime" / "layers").glob("*.py"))
       if p.name != "cpu_gemm.py" and "def matmul(" in p.read_text()},
}
# calls that ask the machine (a probe) or the process's mode
PROBES = {"failure", "gemm_mode", "row_kernel_failure", "amx_failure", "gemm_choice", "quantized_bf16_rows",
          "half_kernel_runs", "half_kernel", "int8_kernel_failure", "int4_kernel_failure", "keeps_second_layout",
          "fast_path_failure", "native_arithmetic", "uses_int8_kernel", "kernel_plan", "_resolve"}
RESOLVER = "mla_runtime/kernel_plan.py"  # where the plan is resolved: its probes are the one decision


def _returns(tree: ast.AST, names: tuple[str, ...]) -> dict[str, int]:
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            found[node.name] = found.get(node.name, 0) + sum(isinstance(n, ast.Return) for n in ast.walk(node))
    return found


def _reads_a_plan(func: ast.expr) -> bool:
    """``plan.x(...)`` / ``self.plan.x(...)``: a question to a resolved plan, not a probe."""
    if not isinstance(func, ast.Attribute):
        return False
    owner = func.value
    name = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
    return name.endswith("plan")


def _calls(tree: ast.AST) -> tuple[int, int]:
    """(probe or mode calls, plan resolutions) in ``tree``."""
    probes = resolutions = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and not _reads_a_plan(node.func):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
            resolutions += name == "kernel_plan"
            # a kernel family's build and check (another object's ``failure`` is not one)
            probes += name in PROBES and name != "kernel_plan" and (name != "failure" or owner in ("cpu_kernels",
                                                                                                  "cpu_ops"))
    return probes, resolutions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    root = ap.parse_args().root
    total = 0
    print(f"{root}\nroutes of one linear call (return statements):")
    for rel, names in LINEAR_FUNCTIONS.items():
        for name, n in _returns(ast.parse((root / rel).read_text()), names).items():
            print(f"  {rel}:{name}  {n}")
            total += n
    print(f"  total {total}")
    sites: dict[str, tuple[int, int]] = {}
    for path in sorted((root / "mla_runtime").rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel != RESOLVER and any(n := _calls(ast.parse(path.read_text()))):
            sites[rel] = n
    probes = {rel: n[0] for rel, n in sites.items() if n[0]}
    print(f"call sites that consult a probe or the mode outside {RESOLVER}: {sum(probes.values())} in "
          f"{len(probes)} files")
    for rel, n in probes.items():
        print(f"  {rel}  {n}")
    resolved = {rel: n[1] for rel, n in sites.items() if n[1]}
    print(f"call sites that resolve the kernel plan (kernel_plan): {sum(resolved.values())}: "
          + ", ".join(f"{rel} {n}" for rel, n in resolved.items()))


if __name__ == "__main__":
    main()
