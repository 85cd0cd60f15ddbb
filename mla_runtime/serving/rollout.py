"""Versioned rollout: two model versions behind one endpoint, the traffic split, promote and rollback.

A replicated deployment (``--replicas``) serves a **stable** version and, with ``--canary-model`` (or
``--canary-revision`` / ``--canary-engine``), a **canary**, each on its own Ray Serve engine deployment (a *slot*).
The ingress asks ``Rollout.choose`` which slot a new request goes to:

- no canary, or weight 0: the stable one;
- a request with a split key (its session, else its prompt's first block hash: the router's affinity key) goes
  where that key went before (the sticky table), else to the canary when the key's hash falls under the weight
  (a deterministic draw: the same key lands on the same side at a given weight, and raising the weight only
  moves keys from stable to canary);
- a request without a key is drawn at random with the weight.

``promote`` makes the canary the stable version and keeps the old stable's snapshot (``previous``: its slot, model,
revision, weights fingerprint and engine settings); ``rollback`` sends every new request to the stable version at
once (weight 0), or, after a promote, makes the previous version stable again. Slots are never torn down: a
rolled-back or superseded version stays deployed (at its minimum replica count when autoscaling), so in-flight
requests finish where they started and a rollback is instant.

``judge`` is the automatic rollback's test (off by default): the canary's error rate or p99 latency over a window,
against the stable's. Everything here is pure Python (no Ray): ``ray_replicas.Ingress`` drives it, and
``main`` is ``mla-runtime rollout``, the operator's client of the admin routes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
import urllib.error
import urllib.request
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mla_runtime.serving.affinity import RouteKey

VERSION_HEADER = "X-Model-Version"
PREVIOUS = "previous"  # the role name of a superseded stable version (after promote)
MAX_STICKY = 100_000  # sessions remembered
MAX_EVENTS = 50
MIN_JUDGED = 20  # requests of each version before the automatic rollback judges


@dataclass
class Version:
    """A deployed model version: where it runs (its Ray Serve deployment) and what it serves."""

    slot: str
    model: str
    revision: str | None = None
    fingerprint: str | None = None  # the weights' fingerprint its replicas report (None: no manifest)
    engine: dict[str, Any] = field(default_factory=dict)  # its engine settings

    def public(self) -> dict[str, Any]:
        return asdict(self)


def split_key(key: RouteKey) -> str | None:
    """The key a request sticks to its version by: its session, else its prompt's first block (None: neither)."""
    if key.session is not None:
        return "s:" + key.session
    if key.block_hashes:
        return f"p:{key.block_hashes[0]:x}"
    return None


def bucket(key: str, salt: str = "") -> float:
    """A deterministic draw in [0, 1) for ``key``."""
    digest = hashlib.sha256(f"{salt}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclass
class Rollout:
    """The versions and the split (the ingress holds one; admin routes change it)."""

    stable: Version
    canary: Version | None = None
    weight: float = 0.0
    stable_name: str = "stable"
    canary_name: str = "canary"
    previous: Version | None = None
    rng: random.Random = field(default_factory=random.Random)
    sticky: OrderedDict[str, str] = field(default_factory=OrderedDict)
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    counts: dict[str, int] = field(default_factory=dict)  # admin actions by name

    def __post_init__(self) -> None:
        self.weight = check_weight(self.weight) if self.canary is not None else 0.0

    # -- routing -------------------------------------------------------------------------------------
    def choose(self, key: RouteKey) -> str:
        """The slot a new request goes to."""
        canary = self.canary
        if canary is None or self.weight <= 0:
            return self.stable.slot
        k = split_key(key)
        if k is None:
            return canary.slot if self.rng.random() < self.weight else self.stable.slot
        slot = self.sticky.get(k)
        if slot in (self.stable.slot, canary.slot):
            self.sticky.move_to_end(k)
            return slot  # type: ignore[return-value]
        slot = canary.slot if bucket(k, canary.model) < self.weight else self.stable.slot
        self.sticky[k] = slot
        while len(self.sticky) > MAX_STICKY:
            self.sticky.popitem(last=False)
        return slot

    def role(self, slot: str) -> str:
        """The version name of a slot: the stable or canary name, or ``previous``."""
        if slot == self.stable.slot:
            return self.stable_name
        if self.canary is not None and slot == self.canary.slot:
            return self.canary_name
        return PREVIOUS

    def weights(self) -> dict[str, float]:
        """Share of new traffic by version name."""
        out = {self.stable_name: 1.0 - self.weight}
        if self.canary is not None:
            out[self.canary_name] = self.weight
        if self.previous is not None:
            out[PREVIOUS] = 0.0
        return out

    def versions(self) -> list[tuple[str, Version]]:
        out = [(self.stable_name, self.stable)]
        if self.canary is not None:
            out.append((self.canary_name, self.canary))
        if self.previous is not None:
            out.append((PREVIOUS, self.previous))
        return out

    # -- admin actions -------------------------------------------------------------------------------
    def set_weight(self, weight: object, why: str = "admin") -> dict[str, Any]:
        if self.canary is None:
            raise RolloutError(409, "there is no canary version to give traffic to (promote made it stable; "
                                    "roll back to try it again, or redeploy with --canary-model)")
        before = self.weight
        self.weight = check_weight(weight)
        if self.weight < before:  # sessions on the canary beyond the new share go back to stable
            self._forget(self.canary.slot, keep_below=self.weight)
        return self._event("set_weight", why, weight_before=before)

    def promote(self, why: str = "admin") -> dict[str, Any]:
        """The canary becomes the stable version; the old stable's snapshot is kept for a rollback."""
        if self.canary is None:
            raise RolloutError(409, "there is no canary version to promote")
        self.previous, self.stable, self.canary = self.stable, self.canary, None
        self.weight = 0.0
        self.sticky.clear()
        return self._event("promote", why)

    def rollback(self, why: str = "admin") -> dict[str, Any]:
        """Every new request to the stable version at once; after a promote, the previous version is stable
        again (and the promoted one the canary, at weight 0)."""
        if self.previous is not None:
            self.stable, self.canary, self.previous = self.previous, self.stable, None
            self.weight = 0.0
            self.sticky.clear()
        elif self.canary is not None:
            self.weight = 0.0
            self._forget(self.canary.slot)
        else:
            raise RolloutError(409, "nothing to roll back: no canary and no previous version")
        return self._event("rollback", why)

    def _forget(self, slot: str, keep_below: float | None = None) -> None:
        salt = self.canary.model if self.canary is not None else ""
        for k in [k for k, s in self.sticky.items() if s == slot and
                  (keep_below is None or bucket(k, salt) >= keep_below)]:
            del self.sticky[k]

    def _event(self, action: str, why: str, **extra: Any) -> dict[str, Any]:
        self.counts[action] = self.counts.get(action, 0) + 1
        event = {"time": time.time(), "action": action, "why": why, "weight": self.weight,
                 "stable": self.stable.fingerprint, **extra}
        self.events.append(event)
        return event

    def status(self) -> dict[str, Any]:
        """``GET /admin/rollout``."""
        return {"weight": self.weight, "weights": self.weights(),
                "versions": {name: v.public() for name, v in self.versions()},
                "sticky_sessions": len(self.sticky), "events": list(self.events)}

    # -- persistence (the ingress keeps it in Ray's key-value store, so a restarted ingress resumes) ----
    def dump(self) -> str:
        return json.dumps({"stable": self.stable.public(), "canary": self.canary and self.canary.public(),
                           "previous": self.previous and self.previous.public(), "weight": self.weight})

    def restore(self, text: str, slots: Sequence[str]) -> bool:
        """Take the roles of a dumped state when it names exactly the deployed slots."""
        data = json.loads(text)
        got = {data[r]["slot"] for r in ("stable", "canary", "previous") if data.get(r)}
        if got != set(slots):
            return False
        self.stable = Version(**data["stable"])
        self.canary = Version(**data["canary"]) if data.get("canary") else None
        self.previous = Version(**data["previous"]) if data.get("previous") else None
        self.weight = check_weight(data["weight"]) if self.canary is not None else 0.0
        return True


class RolloutError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def check_weight(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1 or \
            math.isnan(value):
        raise RolloutError(400, f"weight must be a number in [0, 1], got {value!r}")
    return float(value)


# -- the automatic rollback's test ---------------------------------------------------------------------
@dataclass
class Outcomes:
    """A version's recent requests at the ingress: (time, failed, seconds), for the window."""

    window_s: float
    samples: deque[tuple[float, bool, float]] = field(default_factory=deque)

    def add(self, failed: bool, seconds: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.samples.append((now, failed, seconds))
        self.trim(now)

    def trim(self, now: float) -> None:
        while self.samples and self.samples[0][0] < now - self.window_s:
            self.samples.popleft()

    def summary(self) -> tuple[int, float, float]:
        """(requests, error rate, p99 seconds) in the window."""
        n = len(self.samples)
        if n == 0:
            return 0, 0.0, 0.0
        errors = sum(1 for _, failed, _ in self.samples if failed)
        return n, errors / n, percentile([s for _, _, s in self.samples], 0.99)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def judge(stable: tuple[int, float, float], canary: tuple[int, float, float], error_margin: float,
          latency_factor: float, min_requests: int = MIN_JUDGED) -> str | None:
    """Why the canary should be rolled back, or None. Each argument: (requests, error rate, p99 s) over the
    window; nothing is judged before both versions have ``min_requests``."""
    (n_s, err_s, p99_s), (n_c, err_c, p99_c) = stable, canary
    if n_c < min_requests or n_s < min_requests:
        return None
    if err_c > err_s + error_margin:
        return (f"canary error rate {err_c:.1%} over {n_c} requests exceeds stable's {err_s:.1%} by more than "
                f"{error_margin:.1%}")
    if latency_factor > 0 and p99_s > 0 and p99_c > latency_factor * p99_s:
        return f"canary p99 latency {p99_c:.3f} s exceeds {latency_factor:g} x stable's {p99_s:.3f} s"
    return None


# -- mla-runtime rollout ---------------------------------------------------------------------------------
ACTIONS = ("status", "set-weight", "promote", "rollback")


def request(url: str, method: str, path: str, api_key: str | None, body: Mapping[str, Any] | None = None,
            timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the operator's own URL
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {"error": {"message": e.reason}}


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Change the traffic split of a running replicated "
                                "deployment (mla-runtime serve --replicas N --canary-model PATH) through its "
                                "admin routes.")
    p.add_argument("action", choices=ACTIONS, help="status: versions and weights; set-weight W: the canary's share "
                   "of new sessions; promote: the canary becomes stable; rollback: every new request to stable")
    p.add_argument("weight", nargs="?", type=float, help="set-weight's share, 0..1")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the deployment (default: %(default)s)")
    p.add_argument("--api-key", help="the deployment's API key (default: $MLA_API_KEY)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the answer (default: %(default)s)")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "mla-runtime rollout") -> int:
    from mla_runtime.env import api_key

    args = build_parser(prog).parse_args(argv)
    if (args.action == "set-weight") != (args.weight is not None):
        print(f"{prog}: error: set-weight takes the weight (and only set-weight does)", file=sys.stderr)
        return 2
    key = args.api_key or api_key()
    try:
        if args.action == "status":
            code, answer = request(args.url, "GET", "/admin/rollout", key, timeout=args.timeout)
        else:
            body = {"weight": args.weight} if args.action == "set-weight" else {}
            path = "/admin/rollout/" + args.action.replace("set-", "")
            code, answer = request(args.url, "POST", path, key, body, timeout=args.timeout)
    except (urllib.error.URLError, TimeoutError, ValueError) as e:
        print(f"{prog}: error: {args.url}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2))
    return 0 if code == 200 else 1
