"""``/metrics`` of a replicated server: every replica's series, labelled ``replica``, and the router's own.

The ingress scrapes each replica (its single-process ``/metrics`` text) and merges them here: each family once,
each sample with a ``replica`` label added, plus ``mla_replica_info{replica, pid}`` (the process behind each
replica), ``mla_replicas`` (replicas answering) and ``mla_router_decisions_total{reason}`` (why the router sent
requests where it did: ``session``, ``affinity_hit``, ``load_fallback``, ``least_loaded``, ``round_robin``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass(frozen=True)
class ReplicaScrape:
    replica: str
    pid: int
    text: str


def labelled(scrapes: Iterable[ReplicaScrape]) -> list[Metric]:
    """The replicas' families merged, each sample labelled with its replica."""
    families: dict[str, Metric] = {}
    for scrape in scrapes:
        for fam in text_string_to_metric_families(scrape.text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            merged.samples.extend(Sample(s.name, {**s.labels, "replica": scrape.replica}, s.value, s.timestamp,
                                         s.exemplar) for s in fam.samples)
    return list(families.values())


def render(scrapes: list[ReplicaScrape], decisions: Mapping[str, int]) -> bytes:
    """The ingress's ``/metrics`` body (Prometheus text format)."""
    info = GaugeMetricFamily("mla_replica_info", "Engine replicas answering the scrape, with their process id "
                             "(value 1)", labels=["replica", "pid"])
    for s in scrapes:
        info.add_metric([s.replica, str(s.pid)], 1)
    count = GaugeMetricFamily("mla_replicas", "Engine replicas answering the scrape", value=len(scrapes))
    routed = CounterMetricFamily("mla_router_decisions", "Requests routed, by the reason for the replica chosen",
                                 labels=["reason"])
    for reason, n in decisions.items():
        routed.add_metric([reason], n)
    families = [info, count, routed, *labelled(scrapes)]

    class Snapshot:
        def collect(self) -> list[Metric]:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot())  # type: ignore[arg-type]
    return generate_latest(registry)
