"""``/metrics`` of a replicated server: every replica's series, labelled ``replica``, and the router's own.

The ingress scrapes each replica (its single-process ``/metrics`` text) and merges them here: each family once,
each sample with a ``replica`` label added, plus ``mla_replica_info{replica, pid}`` (the process behind each
replica), ``mla_replicas`` (replicas answering) and ``mla_router_decisions_total{reason}`` (why the router sent
requests where it did: ``session``, ``affinity_hit``, ``load_fallback``, ``least_loaded``, ``round_robin``).
A deployment with model versions (``rollout.py``) adds a ``version`` label to each of these, and the ingress's
rollout and autoscaling families (``extra``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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


def labelled(scrapes: Iterable[ReplicaScrape], versions: Mapping[str, str] | None = None) -> list[Metric]:
    """The replicas' families merged, each sample labelled with its replica (and its version, when given)."""
    families: dict[str, Metric] = {}
    for scrape in scrapes:
        extra = {"replica": scrape.replica}
        if versions is not None:
            extra["version"] = versions.get(scrape.replica, "")
        for fam in text_string_to_metric_families(scrape.text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            merged.samples.extend(Sample(s.name, {**s.labels, **extra}, s.value, s.timestamp, s.exemplar)
                                  for s in fam.samples)
    return list(families.values())


def render(scrapes: list[ReplicaScrape], decisions: Mapping[str, int] | Mapping[str, Mapping[str, int]],
           versions: Mapping[str, str] | None = None, extra: Sequence[Metric] = ()) -> bytes:
    """The ingress's ``/metrics`` body (Prometheus text format). With ``versions`` (replica → version name),
    every replica's series also has a ``version`` label and ``decisions`` is by version, then reason;
    ``extra``: the ingress's own families (rollout, autoscaling)."""
    info = GaugeMetricFamily("mla_replica_info", "Engine replicas answering the scrape, with their process id "
                             "(value 1)", labels=["replica", "pid", *(["version"] if versions is not None else [])])
    for s in scrapes:
        info.add_metric([s.replica, str(s.pid), *([versions.get(s.replica, "")] if versions is not None else [])], 1)
    count = GaugeMetricFamily("mla_replicas", "Engine replicas answering the scrape", value=len(scrapes))
    if versions is None:
        routed = CounterMetricFamily("mla_router_decisions", "Requests routed, by the reason for the replica "
                                     "chosen", labels=["reason"])
        for reason, n in decisions.items():
            routed.add_metric([reason], n)  # type: ignore[arg-type]
    else:
        routed = CounterMetricFamily("mla_router_decisions", "Requests routed, by version and the reason for the "
                                     "replica chosen", labels=["version", "reason"])
        for version, by_reason in decisions.items():
            for reason, n in by_reason.items():  # type: ignore[union-attr]
                routed.add_metric([version, reason], n)
    families = [info, count, routed, *extra, *labelled(scrapes, versions)]

    class Snapshot:
        def collect(self) -> list[Metric]:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot())  # type: ignore[arg-type]
    return generate_latest(registry)
