"""Prometheus metrics of one server, in its own ``CollectorRegistry`` (no process-global state).

Two kinds: what the HTTP layer observes (requests by outcome, latency histograms, token counters, counted
when a request ends), and what the engine knows, read from ``AsyncLLM.stats()`` at scrape time by
``EngineCollector`` (queue depth, running sequences, latent-cache blocks, prefix hits, preemptions) plus
the memory split (weights / latent cache / activation reserve / other).
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mla_runtime.engine.info import EngineInfo, EngineStats
from mla_runtime.layers import cpu_gemm

OUTCOMES = ("success", "invalid", "unauthorized", "too_large", "rejected", "timeout", "stalled",
            "client_disconnect", "aborted", "error")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes & co, for leak/drift checks
        self.requests = Counter("mla_requests", "HTTP generation requests by final outcome",
                                ["endpoint", "outcome"], registry=r)
        self.in_flight = Gauge("mla_requests_in_flight", "Requests admitted and not yet answered", registry=r)
        self.ready = Gauge("mla_ready", "1 once the weights are loaded and the probe generation passed", registry=r)
        self.step_seconds = Gauge("mla_engine_step_seconds", "How long the engine step in progress has run (0 "
                                  "between steps; compared with --step-timeout)", registry=r)
        self.ttft = Histogram("mla_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("mla_time_per_output_token_seconds", "Mean gap between generated tokens",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("mla_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("mla_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.generation_tokens = Counter("mla_generation_tokens", "Tokens generated for requests", registry=r)
        self.cached_prompt_tokens = Counter("mla_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                            registry=r)
        for endpoint in ("generate", "completions", "chat"):
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)

    def attach_engine(self, stats: Callable[[], EngineStats], info: EngineInfo, served_name: str) -> None:
        self.registry.register(EngineCollector(stats, info, served_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _process_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.memory_reserved(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


class EngineCollector(Collector):
    """Engine state at scrape time; ``stats`` is ``AsyncLLM.stats`` (takes the engine lock briefly)."""

    def __init__(self, stats: Callable[[], EngineStats], info: EngineInfo, served_name: str) -> None:
        self.stats = stats
        self.info = info
        self.served_name = served_name  # never the checkpoint's path

    def collect(self) -> Iterator[Metric]:
        s, d = self.stats(), self.info

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("mla_queue_depth", "Sequences waiting for a running slot", s.num_waiting)
        yield gauge("mla_running_sequences", "Sequences in the running batch", s.num_running)
        total, free = s.num_blocks, s.num_free_blocks
        yield gauge("mla_latent_cache_blocks_total", "Latent-cache blocks (capacity)", total)
        yield gauge("mla_latent_cache_blocks_used", "Latent-cache blocks held by sequences", total - free)
        yield gauge("mla_latent_cache_usage_ratio", "Used / total latent-cache blocks", s.cache_usage)
        yield gauge("mla_latent_cache_capacity_tokens", "Tokens the latent cache holds at once",
                    d.max_concurrent_tokens)
        yield gauge("mla_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up",
                    s.prefix_hit_rate)
        yield counter("mla_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache",
                      s.prefix_query_tokens)
        yield counter("mla_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache",
                      s.prefix_hit_tokens)
        yield counter("mla_preemptions", "Sequences preempted (blocks freed, recomputed later)",
                      s.num_preemptions)
        yield from _speculative(s)
        mem = GaugeMetricFamily("mla_memory_bytes", "Memory by part: weights, latent cache, planned activation "
                                "reserve, other (measured process/device memory beyond weights and cache)",
                                labels=["part"])
        weights, cache = d.weight_bytes, d.cache_bytes
        mem.add_metric(["weights"], weights)
        mem.add_metric(["latent_cache"], cache)
        mem.add_metric(["activations_reserve"], d.activation_bytes)
        mem.add_metric(["other"], max(0, _process_memory_bytes(d.device) - weights - cache))
        yield mem
        info = GaugeMetricFamily("mla_model_info", "Served model and cache layout (value 1)",
                                 labels=["model", "dtype", "cache_dtype", "layers", "heads", "d_c", "d_r",
                                         "block_size"])
        info.add_metric([self.served_name] + [str(getattr(d, k)) for k in ("dtype", "cache_dtype", "layers", "heads",
                                                                           "d_c", "d_r", "block_size")], 1)
        yield info
        if d.device == "cpu":
            gemm = cpu_gemm.gemm_info(d.dtype)
            family = GaugeMetricFamily("mla_cpu_gemm_info", "CPU matrix-product path chosen by the load-time probe "
                                       "for the model's weight dtype, its compute dtype and why (value 1)",
                                       labels=list(gemm))
            family.add_metric(list(gemm.values()), 1)
            yield family


def _speculative(s: EngineStats) -> Iterator[CounterMetricFamily]:
    """Speculative-decoding counters, labelled with the method; per draft position (1 = the first draft) the
    drafts proposed and accepted, so that acceptance length = 1 + accepted / verify steps."""
    method = [s.speculative_method]
    for name, doc, value in (
            ("mla_spec_draft_tokens", "Speculative draft tokens proposed", s.num_draft_tokens),
            ("mla_spec_accepted_tokens", "Speculative draft tokens the model accepted", s.num_accepted_tokens),
            ("mla_spec_verify_steps", "Decodes that verified drafts", s.num_spec_steps)):
        family = CounterMetricFamily(name, doc, labels=["method"])
        family.add_metric(method, value)
        yield family
    for name, doc, values in (
            ("mla_spec_position_drafts", "Decodes that proposed a draft at this position", s.drafts_by_position),
            ("mla_spec_position_accepted", "Decodes that accepted the draft at this position "
             "(the accepted length reaches it)", s.accepted_by_position)):
        family = CounterMetricFamily(name, doc, labels=["method", "position"])
        for j, value in enumerate(values):
            family.add_metric(method + [str(j + 1)], value)
        yield family
