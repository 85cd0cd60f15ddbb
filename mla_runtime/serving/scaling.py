"""Autoscaling on load and on latent-cache memory: a Ray Serve custom autoscaling policy around a pure decision.

Ray Serve's default policy counts ongoing requests only, but an MLA replica runs out of latent cache (and
preempts) with few long requests. ``decide`` takes both signals of one version's engine deployment:

- **load**: ongoing requests (Ray Serve's own count, averaged over its look-back window) → ``ceil(ongoing /
  target_ongoing_requests)`` replicas;
- **memory**: the latent-cache usage each replica reports (blocks held by sequences / total, the gauge
  ``mla_latent_cache_usage_ratio`` that the ``MlaLatentCacheHigh`` alert watches), averaged → ``ceil(replicas ×
  usage / target_cache_usage)`` replicas;
- **ahead of need**: both signals' trend over the last minute, projected forward by the measured cold-start time
  of a replica (load and probe generation, which each replica reports), so that a replica started now is ready
  when the projected need arrives (``predicted_load`` / ``predicted_memory``).

The desired count is the largest of these (at least 1). Ray Serve applies the rest around the policy: the
``min/max`` bounds, ``upscale_delay_s`` (a signal must stay above its target that long) and ``downscale_delay_s``
(``--downscale-delay``: replicas are removed only after that much quiet). ``MemoryAwarePolicy`` is the class Ray
Serve's controller instantiates per deployment (``autoscaling_config.policy``); it logs every change of decision
and publishes the latest to Ray's key-value store, from which the ingress exports it on ``/metrics``
(``mla_autoscale_*``). ``decide`` and ``trend`` are pure, for tests.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# a child of Ray Serve's logger: the controller writes it to its log (controller_*.log)
logger = logging.getLogger("ray.serve.mla_runtime.scaling")

REASONS = ("load", "memory", "predicted_load", "predicted_memory", "quiet", "steady")
HISTORY_S = 60.0  # the window a trend is fitted over
MIN_TREND_SPAN_S = 5.0  # a trend needs samples spanning at least this long
DEFAULT_COLD_START_S = 30.0  # until a replica has reported its own
KV_NAMESPACE = "mla-runtime"
PUBLISH_EVERY_S = 1.0
EPS = 1e-9


@dataclass(frozen=True)
class Signals:
    """One deployment's state at a tick."""

    replicas: int  # running
    ongoing: float  # ongoing requests over all its replicas
    cache_usage: float  # mean latent-cache usage over its replicas, 0..1
    cold_start_s: float = DEFAULT_COLD_START_S


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    ongoing_per_replica: float
    predicted_ongoing: float
    predicted_usage: float

    @property
    def direction(self) -> str:
        return {"quiet": "down", "steady": "hold"}.get(self.reason, "up")


def trend(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope (per second) of (time, value) points; 0 with too few or too short a span."""
    if len(points) < 3 or points[-1][0] - points[0][0] < MIN_TREND_SPAN_S:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 0.0 if var <= 0 else sum((t - mt) * (v - mv) for t, v in points) / var


def need(value: float, target: float) -> int:
    return max(0, math.ceil(value / target - EPS)) if target > 0 else 0


def decide(now: Signals, target_ongoing: float, target_cache_usage: float,
           history: Sequence[tuple[float, float, float]] = ()) -> Decision:
    """The replicas one deployment needs: ``history`` holds (time, ongoing, cache usage) samples, the latest last."""
    replicas = max(1, now.replicas)
    ongoing_slope = trend([(t, o) for t, o, _ in history])
    usage_slope = trend([(t, u) for t, _, u in history])
    lead = max(0.0, now.cold_start_s)
    predicted_ongoing = max(now.ongoing, now.ongoing + ongoing_slope * lead)
    predicted_usage = min(1.0, max(now.cache_usage, now.cache_usage + usage_slope * lead))
    needs = {
        "load": need(now.ongoing, target_ongoing),
        "memory": need(replicas * now.cache_usage, target_cache_usage),
        "predicted_load": need(predicted_ongoing, target_ongoing),
        "predicted_memory": need(replicas * predicted_usage, target_cache_usage),
    }
    reason = max(needs, key=lambda r: needs[r])  # ties: the order above (measured before predicted)
    desired = max(1, needs[reason])
    if desired < replicas:
        reason = "quiet"
    elif desired == replicas:
        reason = "steady"
    return Decision(desired, reason, now.ongoing / replicas, predicted_ongoing, predicted_usage)


# -- Ray Serve's side: the policy its controller calls ----------------------------------------------------
def kv_key(app: str | None, deployment: str) -> str:
    return f"scaling/{app or ''}/{deployment}"


class MemoryAwarePolicy:
    """``autoscaling_config={"policy": {"policy_function": "mla_runtime.serving.scaling:MemoryAwarePolicy",
    "policy_kwargs": {...}}}``: Ray Serve's controller makes one per deployment and calls it every tick with an
    ``AutoscalingContext``; it returns the desired replica count (Ray applies the bounds and delays)."""

    def __init__(self, target_ongoing_requests: float, target_cache_usage: float = 0.8) -> None:
        self.target_ongoing = float(target_ongoing_requests)
        self.target_usage = float(target_cache_usage)
        self.history: deque[tuple[float, float, float]] = deque()
        self.cold_start_s = DEFAULT_COLD_START_S
        self.last: Decision | None = None
        self.counts: dict[str, int] = {}
        self.published = 0.0

    def signals(self, ctx: Any) -> Signals:
        metrics: Mapping[str, Mapping[Any, float]] = ctx.aggregated_metrics or {}
        live = set(ctx.running_replicas or ())
        usage = [v for r, v in (metrics.get("cache_usage") or {}).items() if not live or r in live]
        cold = [v for v in (metrics.get("cold_start_s") or {}).values() if v > 0]
        if cold:
            self.cold_start_s = max(cold)
        return Signals(ctx.current_num_replicas, float(ctx.total_num_requests or 0.0),
                       sum(usage) / len(usage) if usage else 0.0, self.cold_start_s)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now_t = ctx.current_time or time.time()
        s = self.signals(ctx)
        self.history.append((now_t, s.ongoing, s.cache_usage))
        while self.history and self.history[0][0] < now_t - HISTORY_S:
            self.history.popleft()
        d = decide(s, self.target_ongoing, self.target_usage, list(self.history))
        low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        bounded = min(max(d.desired, low), high)
        if self.last is None or (bounded, d.reason) != (min(max(self.last.desired, low), high), self.last.reason):
            if bounded != s.replicas or self.last is not None:
                logger.info("autoscale %s: %d -> %d replicas (%s: %.1f ongoing per replica, target %g; cache usage "
                            "%.2f, target %.2f; projected %.1f ongoing, usage %.2f over a %.0f s cold start)",
                            ctx.deployment_name, s.replicas, bounded, d.reason, d.ongoing_per_replica,
                            self.target_ongoing, s.cache_usage, self.target_usage, d.predicted_ongoing,
                            d.predicted_usage, s.cold_start_s)
            if bounded != s.replicas:
                key = f"{d.direction}/{d.reason}"
                self.counts[key] = self.counts.get(key, 0) + 1
        self.last = d
        if now_t - self.published >= PUBLISH_EVERY_S:
            self.published = now_t
            publish(kv_key(ctx.app_name, ctx.deployment_name), {
                "time": now_t, "desired": bounded, "replicas": s.replicas, **asdict(d), **asdict(s),
                "target_ongoing": self.target_ongoing, "target_cache_usage": self.target_usage,
                "counts": self.counts})
        return d.desired, {}


def publish(key: str, record: Mapping[str, Any]) -> None:
    """The latest decision, for the ingress's /metrics (best effort: a failure only loses the export)."""
    try:
        from ray.experimental.internal_kv import _internal_kv_initialized, _internal_kv_put

        if _internal_kv_initialized():
            _internal_kv_put(key, json.dumps(record), overwrite=True, namespace=KV_NAMESPACE)
    except Exception as e:  # noqa: BLE001 - never fail Ray's control loop over an export
        logger.debug("autoscale: could not publish %s: %r", key, e)


def published(key: str) -> dict[str, Any] | None:
    """The latest decision published for a deployment (None: none yet, or no Ray)."""
    try:
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

        if not _internal_kv_initialized():
            return None
        raw = _internal_kv_get(key, namespace=KV_NAMESPACE)
        return json.loads(raw) if raw else None
    except Exception:  # noqa: BLE001
        return None
