"""Rollout rehearsal: canary 5% → 50% → 100% → rollback under steady load, on a local Ray Serve deployment.

    python bench/bench_rollout.py                      # defaults: 1 replica per version, 4 clients, 20 s per step
    python bench/bench_rollout.py --step-seconds 40 --clients 8 --out bench/rollout.json

The stable version is the embedded demo model; the canary is the same architecture with other random weights,
written at run time into a temporary folder (never committed), each with a sha256 manifest so that the two
fingerprints differ. Steady load: ``--clients`` loops, each sending ``/generate`` requests (streamed, greedy,
``--max-tokens``, ``ignore_eos``) with a session id drawn from a pool (a session returns now and then, so the
sticky table is exercised). Steps, each held ``--step-seconds``: canary at 5 %, 50 %, 100 %, then rollback
(``mla-runtime rollout`` through the admin routes). Reported per step and version: requests, errors (anything but
a 200 that ended with ``[DONE]``: must be 0), p50/p99 latency (sent → last event), and the time the step took
(the admin call, and for the rollback the time until the last canary request in flight finished).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "mla_runtime" / "demo_model"
KEY = "sk-rehearsal"


# -- checkpoints -------------------------------------------------------------------------------------
def copy_checkpoint(src: Path, dst: Path) -> str:
    """``src`` copied to ``dst`` with a sha256 manifest; its fingerprint."""
    from mla_runtime import checksums

    shutil.copytree(src, dst, dirs_exist_ok=True)
    checksums.write_manifest(dst)
    fp = checksums.manifest_fingerprint(dst)
    assert fp is not None
    return fp


def random_checkpoint(src: Path, dst: Path, seed: int = 1) -> str:
    """The architecture of ``src`` with other random weights (each tensor drawn with its own mean and std), in
    ``dst`` with a sha256 manifest; its fingerprint."""
    import torch
    from safetensors.torch import load_file, save_file

    from mla_runtime import checksums

    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "SHA256SUMS"))
    gen = torch.Generator().manual_seed(seed)
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(f)
        out = {}
        for name, t in tensors.items():
            if t.is_floating_point() and t.numel() > 1:
                x = t.float()
                out[name] = (torch.randn(x.shape, generator=gen) * x.std() + x.mean()).to(t.dtype).contiguous()
            else:
                out[name] = t.clone()
        save_file(out, dst / f.name, metadata={"format": "pt"})
    checksums.write_manifest(dst)
    fp = checksums.manifest_fingerprint(dst)
    assert fp is not None
    return fp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- load ----------------------------------------------------------------------------------------------
@dataclass
class Result:
    step: str
    version: str
    status: int
    ok: bool
    start: float
    end: float


@dataclass
class Load:
    base: str
    max_tokens: int
    sessions: int
    results: list[Result] = field(default_factory=list)
    step: str = "warm-up"
    running: bool = True

    async def client(self, i: int) -> None:
        import httpx

        rng = random.Random(i)
        async with httpx.AsyncClient(timeout=180, headers={"Authorization": f"Bearer {KEY}"}) as http:
            n = 0
            while self.running:
                n += 1
                session = f"c{i}-{n}" if rng.random() < 0.7 else f"pool-{rng.randrange(self.sessions)}"
                step, t0 = self.step, time.monotonic()
                version, status, ok = "", 0, False
                try:
                    async with http.stream("POST", self.base + "/generate", headers={"X-Session-Id": session},
                                           json={"prompt": f"def handler_{i}_{n}(request):",
                                                 "max_tokens": self.max_tokens, "ignore_eos": True,
                                                 "temperature": 0, "stream": True}) as r:
                        status, version = r.status_code, r.headers.get("x-model-version", "")
                        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                        ok = status == 200 and bool(lines) and lines[-1] == "data: [DONE]" and \
                            not any('"error"' in line for line in lines)
                        if status == 429:
                            await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                except Exception:  # noqa: BLE001 - counted as an error
                    ok = False
                self.results.append(Result(step, version, status, ok, t0, time.monotonic()))


def admin(base: str, action: str, weight: float | None = None) -> float:
    """Runs ``mla-runtime rollout`` in-process; the call's seconds."""
    from mla_runtime.serving.rollout import main as rollout_main

    argv = [action, *([str(weight)] if weight is not None else []), "--url", base, "--api-key", KEY]
    t0 = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()):  # the route's JSON answer
        code = rollout_main(argv)
    if code != 0:
        raise RuntimeError(f"mla-runtime rollout {' '.join(argv)} failed")
    return time.monotonic() - t0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))] if ordered else 0.0


def cpu_line() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    keep = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs, flags {' '.join(keep)}"


async def rehearse(args: argparse.Namespace, base: str) -> dict[str, Any]:
    load = Load(base, args.max_tokens, args.sessions)
    tasks = [asyncio.create_task(load.client(i)) for i in range(args.clients)]
    steps: list[dict[str, Any]] = []
    await asyncio.sleep(args.warmup)
    for name, action, weight in (("5%", "set-weight", 0.05), ("50%", "set-weight", 0.5),
                                 ("100%", "set-weight", 1.0), ("rollback", "rollback", None)):
        changed = time.monotonic()
        took = await asyncio.to_thread(admin, base, action, weight)
        load.step = name
        await asyncio.sleep(args.step_seconds)
        steps.append({"step": name, "admin_s": took, "at": changed})
    load.running = False
    await asyncio.gather(*tasks)
    rows = []
    for s in steps:
        mine = [r for r in load.results if r.step == s["step"]]
        drained, in_flight = None, None
        if s["step"] == "rollback":  # canary requests in flight when the rollback was called, finishing after it
            late = [r for r in load.results if r.version == "canary" and r.start < s["at"] + s["admin_s"]
                    and r.end > s["at"]]
            in_flight = len(late)
            drained = max((r.end - s["at"] for r in late), default=0.0)
        for version in ("stable", "canary"):
            rs = [r for r in mine if r.version == version]
            lat = [r.end - r.start for r in rs if r.ok]
            rows.append({"step": s["step"], "version": version, "requests": len(rs),
                         "errors": sum(1 for r in rs if not r.ok and r.status != 429),
                         "rejected_429": sum(1 for r in rs if r.status == 429),
                         "p50_ms": 1000 * statistics.median(lat) if lat else None,
                         "p99_ms": 1000 * pct(lat, 0.99) if lat else None,
                         "admin_ms": 1000 * s["admin_s"], "drained_s": drained, "in_flight": in_flight})
    unversioned = [r for r in load.results if not r.version]
    return {"rows": rows, "unanswered": len(unversioned),
            "errors_total": sum(1 for r in load.results if not r.ok and r.status != 429)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=1, help="replicas per version")
    p.add_argument("--clients", type=int, default=4, help="concurrent request loops")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--sessions", type=int, default=200, help="the pool of returning sessions")
    p.add_argument("--step-seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)

    from ray import serve

    from mla_runtime.engine.config import EngineConfig
    from mla_runtime.serving import ray_replicas
    from mla_runtime.serving.config import ReplicaConfig, ServerConfig

    tmp = Path(tempfile.mkdtemp(prefix="rollout-"))
    try:
        stable_fp = copy_checkpoint(DEMO, tmp / "stable")
        canary_fp = random_checkpoint(DEMO, tmp / "canary")
        rc = ReplicaConfig(replicas=args.replicas, canary_model=str(tmp / "canary"), canary_weight=0.0,
                           replica_cpus=1)
        started = ray_replicas.start_ray(rc)
        port = free_port()
        engine = EngineConfig(model=str(tmp / "stable"), dtype="float32", max_model_len=512, max_num_seqs=8)
        config = ServerConfig(port=port, served_model_name="demo", api_key=KEY, request_timeout=120,
                              max_queue=64)
        t0 = time.monotonic()
        ray_replicas.deploy(engine, config, rc)
        print(f"deployed in {time.monotonic() - t0:.1f} s: stable {stable_fp}, canary {canary_fp}", file=sys.stderr)
        try:
            out = asyncio.run(rehearse(args, f"http://127.0.0.1:{port}"))
        finally:
            serve.shutdown()
            if started:
                import ray

                ray.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out.update(cpu=cpu_line(), args=vars(args) | {"out": str(args.out) if args.out else None},
               fingerprints={"stable": stable_fp, "canary": canary_fp})
    print("| step | version | requests | errors | 429 | p50 ms | p99 ms | admin call ms | canary in flight | "
          "canary drained s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in out["rows"]:
        def f(v: Any, fmt: str = "{:.0f}") -> str:
            return "–" if v is None else fmt.format(v)

        print(f"| {r['step']} | {r['version']} | {r['requests']} | {r['errors']} | {r['rejected_429']} | "
              f"{f(r['p50_ms'])} | {f(r['p99_ms'])} | {f(r['admin_ms'])} | {f(r['in_flight'])} | "
              f"{f(r['drained_s'], '{:.2f}')} |")
    print(f"errors in total: {out['errors_total']}; {out['cpu']}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    return 0 if out["errors_total"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
