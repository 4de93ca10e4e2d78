"""Prometheus metrics under vLLM's names and labels (model_name, and engine: the data-parallel replica, "0" with
one engine, as vLLM labels them), and the periodic stats log line.

Two sources feed them:
- engine-wide numbers come from `EngineClient.stats()` snapshots, one per replica where the engine has several
  (`stats_per_engine()`, jaxllm/engine/dp.py): gauges and totals, exported through a custom collector so
  counters are the engine's own totals, and iteration sizes folded into a histogram;
- per-request latencies and sizes are observed by the server as outputs stream past (RequestTracker), labelled
  with the replica that served the request (`engine_index(request_id)`).
Every snapshot goes through `ServerMetrics.poll()` because its `iteration_tokens` list holds only the steps
since the previous snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxllm.engine.protocol import EngineClient, EngineStats
from jaxllm.outputs import RequestOutput

logger = logging.getLogger("jaxllm.server")

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0]


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(float(m * scale))
        scale *= 10


LABELS = ["model_name", "engine"]

# (name, help, EngineStats field) of the snapshot's gauges, then its counters
_GAUGES = (("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
           ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
           ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"))
_COUNTERS = (("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
              "prefix_cache_queries"),
             ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
             ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", "num_preemptions"),
             ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
             ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"))


class _EngineCollector:
    """Exports the latest engine snapshots (one per replica) as gauges and counters at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        self.metrics.poll()
        per_engine = self.metrics.last_per_engine
        for family, specs in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for metric, doc, field in specs:
                m = family(metric, doc, labels=LABELS)
                for i, s in enumerate(per_engine):
                    m.add_metric([self.metrics.model_name, str(i)], getattr(s, field))
                yield m


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.last = EngineStats()
        self.last_per_engine = [EngineStats()] * int(getattr(engine, "num_engines", 1))
        self._stats_failures = 0
        r, labels = self.registry, LABELS
        self.registry.register(_EngineCollector(self))
        tokens = _token_buckets(max(int(getattr(engine, "max_model_len", 0) or 0), 1))
        self._request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                        LABELS + ["finished_reason"], registry=r)
        families = dict(
            ttft=Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                           labels, buckets=_LATENCY_BUCKETS, registry=r),
            itl=Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                          labels, buckets=_ITL_BUCKETS, registry=r),
            e2e=Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                          labels, buckets=_E2E_BUCKETS, registry=r),
            queue_time=Histogram("vllm:request_queue_time_seconds",
                                 "Histogram of time spent in WAITING phase for request.",
                                 labels, buckets=_E2E_BUCKETS, registry=r),
            prompt_tokens=Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                    labels, buckets=tokens, registry=r),
            generation_tokens=Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                        labels, buckets=tokens, registry=r),
            iteration_tokens=Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                       labels, buckets=[1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                                        16384], registry=r))
        # per replica: an object with one labelled child of each histogram (.ttft, .itl, ...)
        self.engines = [_EngineHistograms(families, [model_name, str(i)]) for i in range(len(self.last_per_engine))]

    def for_engine(self, i: int) -> _EngineHistograms:
        return self.engines[i] if 0 <= i < len(self.engines) else self.engines[0]

    def request_success(self, engine: int, reason: str):
        return self._request_success.labels(self.model_name, str(engine), reason)

    def poll(self) -> EngineStats:
        """Takes an engine snapshot, all replicas together (every caller must come through here: it drains
        iteration_tokens); last_per_engine keeps each replica's."""
        try:
            per_engine = self.engine.stats_per_engine() if hasattr(self.engine, "stats_per_engine") else None
            s = self.engine.stats() if per_engine is None else _merge(per_engine)
        except Exception:  # a broken engine must not break /metrics or the log loop
            self._stats_failures += 1
            if self._stats_failures == 1:
                logger.exception("engine.stats() failed; metrics show the last good snapshot (logged once)")
            return self.last
        per_engine = per_engine or [s]
        for i, e in enumerate(per_engine):
            for n in e.iteration_tokens:
                self.engines[min(i, len(self.engines) - 1)].iteration_tokens.observe(n)
        self.last, self.last_per_engine = s, per_engine
        return s

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, request_id: str = "") -> RequestTracker:
        return RequestTracker(self, request_id)


class _EngineHistograms:
    """One replica's children of the request histograms."""

    def __init__(self, families: dict, labels: list[str]):
        for name, family in families.items():
            setattr(self, name, family.labels(*labels))


def _merge(stats: list[EngineStats]) -> EngineStats:
    from jaxllm.engine.dp import merge_stats

    return merge_stats(stats)


class RequestTracker:
    """Observes one engine request's latencies and sizes as its outputs arrive, under the label of the replica
    that serves it (known once the engine has it: looked up at its first output)."""

    __slots__ = ("m", "request_id", "h", "arrival", "first_token", "last_token", "num_tokens", "done")

    def __init__(self, metrics: ServerMetrics, request_id: str = ""):
        self.m = metrics
        self.request_id = request_id
        self.h: _EngineHistograms | None = None
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0
        self.done = False

    def _histograms(self) -> _EngineHistograms:
        if self.h is None:
            index = getattr(self.m.engine, "engine_index", None)
            self.h = self.m.for_engine(index(self.request_id) if index is not None else 0)
        return self.h

    def on_output(self, out: RequestOutput) -> None:
        n = sum(len(o.token_ids) for o in out.outputs)
        now = time.monotonic()
        if n > self.num_tokens:
            if self.first_token is None:
                self.first_token = now
                self._histograms().ttft.observe(now - self.arrival)
            elif self.last_token is not None:
                self._histograms().itl.observe(now - self.last_token)
            self.last_token = now
            self.num_tokens = n
        if out.finished:
            self._finish(out, [o.finish_reason or "stop" for o in out.outputs])

    def on_abort(self, out: RequestOutput | None, n: int) -> None:
        if not self.done:
            self._finish(out, ["abort"] * n)

    def _finish(self, out: RequestOutput | None, reasons: list[str]) -> None:
        self.done = True
        h = self._histograms()
        h.e2e.observe(time.monotonic() - self.arrival)
        engine = self.m.engines.index(h)
        for reason in reasons:
            self.m.request_success(engine, reason).inc()
        if out is None:
            return
        h.prompt_tokens.observe(len(out.prompt_token_ids or []))
        h.generation_tokens.observe(sum(len(o.token_ids) for o in out.outputs))
        rm = out.metrics
        if rm is not None and rm.first_scheduled_time is not None and rm.arrival_time is not None:
            h.queue_time.observe(max(rm.first_scheduled_time - rm.arrival_time, 0.0))


class StatsLogger:
    """Logs vLLM's periodic line; quiet while the engine stays idle."""

    def __init__(self, metrics: ServerMetrics, interval: float):
        self.metrics = metrics
        self.interval = interval
        self._prev = (time.monotonic(), 0, 0)
        self._was_idle = True

    def line(self) -> str | None:
        s = self.metrics.poll()
        now = time.monotonic()
        t0, p0, g0 = self._prev
        dt = max(now - t0, 1e-6)
        prompt_tput = (s.prompt_tokens - p0) / dt
        gen_tput = (s.generation_tokens - g0) / dt
        self._prev = (now, s.prompt_tokens, s.generation_tokens)
        idle = s.num_running == 0 and s.num_waiting == 0 and prompt_tput == 0 and gen_tput == 0
        if idle and self._was_idle:
            return None
        self._was_idle = idle
        hit_rate = 100.0 * s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        return (
            f"Avg prompt throughput: {prompt_tput:.1f} tokens/s, Avg generation throughput: {gen_tput:.1f} tokens/s, "
            f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
            f"GPU KV cache usage: {100.0 * s.kv_cache_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%"
        )

    async def run(self) -> None:
        s = self.metrics.poll()
        self._prev = (time.monotonic(), s.prompt_tokens, s.generation_tokens)
        while True:
            await asyncio.sleep(self.interval)
            try:
                line = self.line()
            except Exception:
                logger.exception("stats logging failed")
                continue
            if line:
                logger.info(line)
