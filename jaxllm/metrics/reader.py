"""vLLM's metrics reader (vllm.v1.metrics.reader): the Prometheus metrics of an engine as plain objects, what
LLM.get_metrics() returns. Gauges and counters one object per label set; a histogram one object with its buckets
(upper bound "le" -> cumulative count, "+Inf" included), count and sum; vllm:spec_decode_num_accepted_tokens_per_pos,
a counter per draft position, one Vector of the positions' counts."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]


def _key(labels: dict[str, str], drop: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != drop))


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """The registry's vllm: metrics of the types above (other collector types are left out, as vLLM's reader does)."""
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        if family.type == "gauge":
            out += [Gauge(family.name, dict(s.labels), float(s.value)) for s in family.samples]
        elif family.type == "counter":
            totals = [s for s in family.samples if s.name == family.name + "_total"]
            if family.name == PER_POSITION:
                by_labels: dict[tuple, dict[int, int]] = {}
                for s in totals:
                    by_labels.setdefault(_key(s.labels, "position"), {})[int(s.labels["position"])] = int(s.value)
                for key, counts in by_labels.items():
                    values = [counts.get(p, 0) for p in range(max(counts) + 1)]
                    out.append(Vector(family.name, dict(key), values))
            else:
                out += [Counter(family.name, dict(s.labels), int(s.value)) for s in totals]
        elif family.type == "histogram":
            hists: dict[tuple, Histogram] = {}
            for s in family.samples:
                key = _key(s.labels, "le")
                h = hists.setdefault(key, Histogram(family.name, dict(key), 0, 0.0, {}))
                if s.name == family.name + "_bucket":
                    h.buckets[s.labels["le"]] = int(s.value)
                elif s.name == family.name + "_count":
                    h.count = int(s.value)
                elif s.name == family.name + "_sum":
                    h.sum = float(s.value)
            out += hists.values()
    return out
