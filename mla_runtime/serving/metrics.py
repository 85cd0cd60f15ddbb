"""Prometheus metrics of one server, in its own ``CollectorRegistry`` (no process-global state).

Two kinds: what the HTTP layer observes (requests by outcome, latency histograms, token counters, counted
when a request ends), and what the engine knows, read from ``AsyncLLM.stats()`` at scrape time by
``EngineCollector`` (queue depth, running sequences, latent-cache blocks, prefix hits, preemptions) plus
the memory split (weights / latent cache / activation reserve / other), and the prefix cache per tier
(``mla_kv_tier_*{tier="device"|"host"|"disk"}``: hits, misses, evictions, capacity; the host and disk tiers' bytes
read, written and held; the disk tier's write queue depth, dropped writes and corrupt files).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mla_runtime.engine.info import EngineInfo, EngineStats

OUTCOMES = ("success", "invalid", "unauthorized", "too_large", "rejected", "timeout", "stalled",
            "client_disconnect", "aborted", "error")
ENDPOINTS = ("generate", "completions", "chat", "responses", "messages", "responses_retrieve", "responses_delete")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes & co, for leak/drift checks
        self.requests = Counter("mla_requests", "HTTP API requests by final outcome (the generation routes, and the "
                                "retrieval and deletion of kept responses)",
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
        for endpoint in ENDPOINTS:
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


def memory_limit_bytes() -> int:
    """What this process may use: its cgroup's memory limit (v2, else v1) when set, else the host's RAM."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 reports "no limit" as a huge number
            return int(text)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class EngineCollector(Collector):
    """Engine state at scrape time; ``stats`` is ``AsyncLLM.stats`` (takes the engine lock briefly)."""

    def __init__(self, stats: Callable[[], EngineStats], info: EngineInfo, served_name: str) -> None:
        self.stats = stats
        self.info = info
        self.served_name = served_name  # never the checkpoint's path
        self.memory_limit = memory_limit_bytes()

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
        yield from _tier_metrics(s, d)
        yield counter("mla_preemptions", "Sequences preempted (blocks freed, recomputed later)",
                      s.num_preemptions)
        yield gauge("mla_prefix_cache_idle_blocks", "Free latent-cache blocks still holding an indexed prefix "
                    "(reusable, freed first under pressure)", s.num_idle_cached_blocks)
        yield gauge("mla_cache_watermark_ratio", "Fraction of the latent-cache blocks (in use or cached) above which "
                    "idle cached prefix blocks are freed between steps", s.cache_watermark)
        yield counter("mla_cache_pressure_freed_blocks", "Idle cached prefix blocks freed above the watermark",
                      s.pressure_freed_blocks)
        yield counter("mla_cache_pressure_seconds", "Seconds the latent-cache blocks in use or cached stayed above "
                      "the watermark", s.seconds_above_watermark)
        yield from _speculative(s)
        yield from _memory_metrics(d)
        yield gauge("mla_memory_limit_bytes", "Memory this process may use: its cgroup limit, else the host's RAM "
                    "(compare with process_resident_memory_bytes)", self.memory_limit)
        info = GaugeMetricFamily("mla_model_info", "Served model, cache layout and the weights' sha256 fingerprint "
                                 "(value 1)", labels=["model", "dtype", "cache_dtype", "layers", "heads", "d_c", "d_r",
                                                      "block_size", "weights", "weights_verified", "attention_backend"])
        info.add_metric([self.served_name] + [str(getattr(d, k)) for k in ("dtype", "cache_dtype", "layers", "heads",
                                                                           "d_c", "d_r", "block_size")]
                        + [d.weights_fingerprint or "unknown", str(d.weights_verified).lower(), d.attention_backend], 1)
        yield info
        if d.cpu_gemm:
            gemm = d.cpu_gemm
            family = GaugeMetricFamily("mla_cpu_gemm_info", "CPU matrix-product path chosen by the load-time probe "
                                       "for the model's weight dtype, its compute dtype and why (value 1)",
                                       labels=list(gemm))
            family.add_metric(list(gemm.values()), 1)
            yield family


def _memory_metrics(d: EngineInfo) -> Iterator[GaugeMetricFamily]:
    """Memory by part, and the caches' sizes: the latent cache's bytes per token, a hybrid's state bytes per
    sequence."""
    mem = GaugeMetricFamily("mla_memory_bytes", "Memory by part: weights, latent cache, a hybrid model's state cache "
                            "and state snapshots, planned activation reserve, other (measured process/device memory "
                            "beyond weights and caches)", labels=["part"])
    weights, caches = d.weight_bytes, d.cache_bytes + d.state_bytes + d.state_snapshot_bytes
    mem.add_metric(["weights"], weights)
    mem.add_metric(["latent_cache"], d.cache_bytes)
    mem.add_metric(["state_cache"], d.state_bytes)
    mem.add_metric(["state_snapshots"], d.state_snapshot_bytes)
    mem.add_metric(["activations_reserve"], d.activation_bytes)
    mem.add_metric(["other"], max(0, _process_memory_bytes(d.device) - weights - caches))
    yield mem
    yield GaugeMetricFamily("mla_latent_cache_bytes_per_token", "Latent-cache bytes of one token (all MLA layers)",
                            value=d.cache_bytes_per_token)
    yield GaugeMetricFamily("mla_state_cache_bytes_per_sequence", "A hybrid model's linear-attention state bytes "
                            "of one running sequence (0: no linear-attention layers)", value=d.state_bytes_per_sequence)


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


def _tier_metrics(s: EngineStats, d: EngineInfo) -> Iterator[Metric]:
    """The prefix cache per tier: the device pool, and the host-RAM and disk tiers when they are on."""
    host, disk = s.host, s.disk
    tiers = ["device"] + (["host"] if host is not None else []) + (["disk"] if disk is not None else [])
    values: dict[str, dict[str, float]] = {
        "hits_tokens": {"device": s.prefix_device_hit_tokens, "host": s.prefix_host_hit_tokens,
                        "disk": s.prefix_disk_hit_tokens},
        "misses_tokens": {"device": s.prefix_query_tokens - s.prefix_device_hit_tokens,
                          "host": s.prefix_host_query_tokens - s.prefix_host_hit_tokens,
                          "disk": s.prefix_disk_query_tokens - s.prefix_disk_hit_tokens},
        "evictions": {"device": s.num_evictions, "host": host.evictions if host is not None else 0,
                      "disk": disk.evictions if disk is not None else 0},
        "capacity_tokens": {"device": d.max_concurrent_tokens, "host": d.host_capacity_tokens,
                            "disk": d.disk_capacity_tokens},
    }
    docs = {"hits_tokens": "Prompt tokens found in this tier of the prefix cache",
            "misses_tokens": "Prompt tokens looked up in this tier and not found there",
            "evictions": "Blocks (device, host) or files (disk) evicted to make room",
            "capacity_tokens": "Tokens this tier holds"}
    for name, per_tier in values.items():
        kind = GaugeMetricFamily if name == "capacity_tokens" else CounterMetricFamily
        family = kind(f"mla_kv_tier_{name}", docs[name], labels=["tier"])
        for tier in tiers:
            family.add_metric([tier], per_tier[tier])
        yield family
    yield from _io_metrics(s)


def _io_metrics(s: EngineStats) -> Iterator[Metric]:
    """Bytes in and out of the host and disk tiers; the disk tier's queue, drops, corrupt files and usage."""
    host, disk = s.host, s.disk
    rows: list[tuple[str, str, str, float, bool]] = []
    if host is not None:
        rows += [("read_bytes", "host", "", host.bytes_loaded, True),
                 ("written_bytes", "host", "", host.bytes_stored, True),
                 ("usage_bytes", "host", "", host.usage_bytes, False)]
    if disk is not None:
        rows += [
            ("read_bytes", "disk", "", disk.bytes_read, True),
            ("written_bytes", "disk", "", disk.bytes_written, True),
            ("write_queue_depth", "disk", "Blocks copied out of the device pool, waiting to be written",
             disk.write_queue_depth, False),
            ("write_drops", "disk", "Blocks not written because the write queue was full", disk.write_drops, True),
            ("corrupt_files", "disk", "Truncated, corrupt or foreign files found, deleted and read as misses",
             disk.corrupt_files, True),
            ("usage_bytes", "disk", "", disk.usage_bytes, False)]
    docs = {"read_bytes": "Bytes read from the tier (host: copied back to the device; disk: file bytes)",
            "written_bytes": "Bytes written to the tier (host: copied from the device; disk: file bytes by this "
                             "process)",
            "usage_bytes": "Bytes the tier holds (disk: the directory, last scan plus own writes)"}
    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
    for name, tier, doc, value, is_counter in rows:
        if name not in families:
            kind: type[CounterMetricFamily | GaugeMetricFamily] = CounterMetricFamily if is_counter else \
                GaugeMetricFamily
            families[name] = kind(f"mla_kv_tier_{name}", doc or docs[name], labels=["tier"])
        families[name].add_metric([tier], value)
    yield from families.values()
