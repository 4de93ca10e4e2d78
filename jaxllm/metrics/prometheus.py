"""Prometheus metrics under vLLM's names and labels (model_name, and engine: the data-parallel replica, "0" with
one engine, as vLLM labels them), for the server's /metrics and the offline LLM.get_metrics().

Two sources feed them:
- engine-wide numbers come from `EngineClient.stats()` snapshots, one per replica where the engine has several
  (`stats_per_engine()`, jaxllm/engine/dp.py): gauges and totals, exported through a custom collector so
  counters are the engine's own totals, and iteration sizes folded into a histogram;
- per-request latencies and sizes are observed as each request's outputs go past (RequestTracker), labelled with
  the replica that served the request (`engine_index(request_id)`): the server's streamed outputs, or the offline
  LLM's final ones with the engine's timestamps of the request (and the engine's inter-token latencies).
Every snapshot goes through `EngineMetrics.poll()` because its `iteration_tokens` list holds only the steps
since the previous snapshot.

The names dashboards of vLLM 0.4-0.10 read are there too, computed as vLLM did: vllm:gpu_cache_usage_perc
(= kv_cache_usage_perc), vllm:time_per_output_token_seconds (= inter_token_latency_seconds),
vllm:num_requests_swapped and vllm:cpu_cache_usage_perc (0: preemption recomputes, nothing is swapped to CPU),
vllm:avg_prompt_throughput_toks_per_s / avg_generation_throughput_toks_per_s (tokens of the last whole
throughput interval over its length, as V0's stats logger set them every interval), vllm:request_params_n (each
finished request's n) and vllm:cache_config_info (a gauge at 1 labelled with the engine's cache config).
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxllm.engine.protocol import EngineClient, EngineStats
from jaxllm.outputs import RequestOutput

logger = logging.getLogger("jaxllm")

_LATENCY_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
_ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
_E2E_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]


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

# (name, help, EngineStats field or None for 0) of the snapshot's gauges, then its counters
_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    (
        "vllm:gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        "kv_cache_usage",
    ),
    (
        "vllm:cpu_cache_usage_perc",
        "CPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: KV cache offloading is not used in V1",
        None,
    ),
    (
        "vllm:num_requests_swapped",
        "Number of requests swapped to CPU. DEPRECATED: KV cache offloading is not used in V1",
        None,
    ),
)
_COUNTERS = (
    (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        "prefix_cache_queries",
    ),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
    ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", "num_preemptions"),
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
)
_THROUGHPUT = (
    ("vllm:avg_prompt_throughput_toks_per_s", "Average prefill throughput in tokens/s."),
    ("vllm:avg_generation_throughput_toks_per_s", "Average generation throughput in tokens/s."),
)
_SPEC_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "num_accepted_tokens"),
)


class _EngineCollector:
    """Exports the latest engine snapshots (one per replica) as gauges and counters at scrape time."""

    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics

    def collect(self):
        m, per_engine = self.metrics, self.metrics.last_per_engine
        labels = [[m.model_name, str(i)] for i in range(len(per_engine))]
        for family, specs in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for metric, doc, field in specs:
                f = family(metric, doc, labels=LABELS)
                for label, s in zip(labels, per_engine, strict=True):
                    f.add_metric(label, getattr(s, field) if field else 0)
                yield f
        rates = [t.rates(s) for t, s in zip(m.throughput, per_engine, strict=True)]
        for j, (metric, doc) in enumerate(_THROUGHPUT):
            g = GaugeMetricFamily(metric, doc, labels=LABELS)
            for label, r in zip(labels, rates, strict=True):
                g.add_metric(label, r[j])
            yield g
        if m.cache_info:
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labels=list(m.cache_info[0]) + ["engine"],
            )
            for i, labels_i in enumerate(m.cache_info):
                info.add_metric(list(labels_i.values()) + [str(i)], 1)
            yield info
        spec = [(label, s.spec_decode) for label, s in zip(labels, per_engine, strict=True) if s.spec_decode]
        if spec:  # only with speculative decoding on, as vLLM registers them
            for metric, doc, field in _SPEC_COUNTERS:
                c = CounterMetricFamily(metric, doc, labels=LABELS)
                for label, sd in spec:
                    c.add_metric(label, getattr(sd, field))
                yield c
            per_pos = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=LABELS + ["position"],
            )
            for label, sd in spec:
                for pos, n in enumerate(sd.num_accepted_tokens_per_pos):
                    per_pos.add_metric(label + [str(pos)], n)
            yield per_pos


class IntervalThroughput:
    """Prompt and generation tokens per second over the last whole interval (vLLM V0's avg_*_throughput gauges,
    which its stats logger set every local interval): rates(snapshot) rolls to a new interval once `interval`
    seconds have passed since the last roll and returns the rates of the last finished one."""

    def __init__(self, interval: float, clock=time.monotonic):
        self.interval, self.clock = interval, clock
        self._start: tuple[float, int, int] | None = None
        self._rates = (0.0, 0.0)

    def rates(self, s: EngineStats) -> tuple[float, float]:
        now = self.clock()
        if self._start is None:
            self._start = (now, s.prompt_tokens, s.generation_tokens)
        t0, p0, g0 = self._start
        if now - t0 >= self.interval:
            self._rates = ((s.prompt_tokens - p0) / (now - t0), (s.generation_tokens - g0) / (now - t0))
            self._start = (now, s.prompt_tokens, s.generation_tokens)
        return self._rates


class EngineMetrics:
    def __init__(self, engine: EngineClient, model_name: str, throughput_interval: float = 5.0):
        self.engine = engine
        self.model_name = model_name
        info = getattr(engine, "cache_config_info", None)
        per_engine = getattr(engine, "cache_config_info_per_engine", None)
        self.cache_info: list[dict[str, str]] = per_engine() if per_engine else [info()] if info else []
        self.registry = CollectorRegistry(auto_describe=True)
        self.last = EngineStats()
        self.last_per_engine = [EngineStats()] * int(getattr(engine, "num_engines", 1))
        self.throughput = [IntervalThroughput(throughput_interval) for _ in self.last_per_engine]
        self._stats_failures = 0
        r, labels = self.registry, LABELS
        tokens = _token_buckets(max(int(getattr(engine, "max_model_len", 0) or 0), 1))
        self._request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            LABELS + ["finished_reason"],
            registry=r,
        )
        families = dict(
            ttft=Histogram(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                labels,
                buckets=_LATENCY_BUCKETS,
                registry=r,
            ),
            itl=Histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                labels,
                buckets=_ITL_BUCKETS,
                registry=r,
            ),
            tpot=Histogram(
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds."
                "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
                labels,
                buckets=_ITL_BUCKETS,
                registry=r,
            ),
            n_param=Histogram(
                "vllm:request_params_n",
                "Histogram of the n request parameter.",
                labels,
                buckets=[1, 2, 5, 10, 20],
                registry=r,
            ),
            e2e=Histogram(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                labels,
                buckets=_E2E_BUCKETS,
                registry=r,
            ),
            queue_time=Histogram(
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                labels,
                buckets=_E2E_BUCKETS,
                registry=r,
            ),
            inference_time=Histogram(
                "vllm:request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
                labels,
                buckets=_E2E_BUCKETS,
                registry=r,
            ),
            prefill_time=Histogram(
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                labels,
                buckets=_E2E_BUCKETS,
                registry=r,
            ),
            decode_time=Histogram(
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                labels,
                buckets=_E2E_BUCKETS,
                registry=r,
            ),
            max_tokens=Histogram(
                "vllm:request_params_max_tokens",
                "Histogram of the max_tokens request parameter.",
                labels,
                buckets=tokens,
                registry=r,
            ),
            max_generation_tokens=Histogram(
                "vllm:request_max_num_generation_tokens",
                "Histogram of maximum number of requested generation tokens.",
                labels,
                buckets=tokens,
                registry=r,
            ),
            prompt_tokens=Histogram(
                "vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels, buckets=tokens, registry=r
            ),
            generation_tokens=Histogram(
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
                labels,
                buckets=tokens,
                registry=r,
            ),
            iteration_tokens=Histogram(
                "vllm:iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                labels,
                buckets=[1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
                registry=r,
            ),
        )
        # per replica: an object with one labelled child of each histogram (.ttft, .itl, ...)
        self.engines = [_EngineHistograms(families, [model_name, str(i)]) for i in range(len(self.last_per_engine))]
        for i in range(len(self.engines)):  # every finish reason shown from the start, at 0 (vLLM v1's)
            for reason in ("stop", "length", "abort"):
                self.request_success(i, reason)
        self.registry.register(_EngineCollector(self))

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
        pop_intervals = getattr(self.engine, "pop_token_intervals", None)
        for dt in pop_intervals() if pop_intervals is not None else ():  # offline: the engine's own (LLM)
            self.engines[0].itl.observe(dt)
            self.engines[0].tpot.observe(dt)
        self.last, self.last_per_engine = s, per_engine
        return s

    def render(self) -> bytes:
        # The snapshot first: the registry renders the iteration-tokens histogram before this collector, so a poll
        # from collect() showed each scrape the steps up to the one before (~10 s late between scrapes)
        self.poll()
        return generate_latest(self.registry)

    def tracker(
        self, request_id: str = "", max_tokens: int | None = None, engine_times: bool = False
    ) -> RequestTracker:
        return RequestTracker(self, request_id, max_tokens, engine_times)


class _EngineHistograms:
    """One replica's children of the request histograms."""

    def __init__(self, families: dict, labels: list[str]):
        for name, family in families.items():
            setattr(self, name, family.labels(*labels))


def _merge(stats: list[EngineStats]) -> EngineStats:
    from jaxllm.engine.dp import merge_stats

    return merge_stats(stats)


class RequestTracker:
    """Observes one engine request's latencies and sizes as its DELTA outputs arrive (each carries only its new
    tokens, and each sequence's finish once), under the label of the replica that serves it (known once the
    engine has it: looked up at its first output). Each of its n sequences counts as a request, as vLLM v1's child
    requests do: its TTFT, and at its finish its e2e latency, prompt and generation tokens, queue time and success.
    Its prefill, decode and inference (running) times come from the engine's timestamps of the request (its first
    scheduling, first and latest token) when the sequence finishes. Inter-token latencies are the request's;
    request_params_n, request_params_max_tokens and request_max_num_generation_tokens (its sequences' most tokens)
    are observed once, when the request is done."""

    __slots__ = (
        "m",
        "request_id",
        "max_tokens",
        "engine_times",
        "h",
        "arrival",
        "last_token",
        "seq_tokens",
        "finished",
        "done",
    )

    def __init__(
        self, metrics: EngineMetrics, request_id: str = "", max_tokens: int | None = None, engine_times: bool = False
    ):
        self.m = metrics
        self.request_id = request_id
        self.max_tokens = max_tokens
        # engine_times (the offline LLM, which sees each request's final output only): TTFT and e2e latency from the
        # engine's timestamps of the request, inter-token latencies from the engine (EngineMetrics.poll)
        self.engine_times = engine_times
        self.h: _EngineHistograms | None = None
        self.arrival = time.monotonic()
        self.last_token: float | None = None
        self.seq_tokens: dict[int, int] = {}  # each sequence's tokens so far (those with any)
        self.finished: set[int] = set()  # the sequences that have finished
        self.done = False

    def _histograms(self) -> _EngineHistograms:
        if self.h is None:
            index = getattr(self.m.engine, "engine_index", None)
            self.h = self.m.for_engine(index(self.request_id) if index is not None else 0)
        return self.h

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if not isinstance(out.outputs, list):  # an embedding request's one output (no tokens generated)
            if out.finished and not self.done:
                self._finish_seq(out, 0, "stop", now)
                self._done()
            return
        if any(o.token_ids for o in out.outputs) and not self.engine_times:
            if self.last_token is not None:
                self._histograms().itl.observe(now - self.last_token)
                self._histograms().tpot.observe(now - self.last_token)
            self.last_token = now
        for o in out.outputs:
            if o.token_ids:
                if o.index not in self.seq_tokens:
                    self._histograms().ttft.observe(self._since_arrival(out, "first_token_time", now))
                self.seq_tokens[o.index] = self.seq_tokens.get(o.index, 0) + len(o.token_ids)
            if o.finish_reason is not None and o.index not in self.finished:
                self._finish_seq(out, o.index, o.finish_reason, now)
        if out.finished:
            self._done()

    def on_abort(self, out: RequestOutput | None, n: int) -> None:
        """out: the latest output the route read (None: none yet); n: the request's sequences (those not finished
        count as aborted, with the tokens on_output counted for them)."""
        if not self.done:
            now = time.monotonic()
            for i in range(n):
                if i not in self.finished:
                    self._finish_seq(out, i, "abort", now)
            self._done()

    def _finish_seq(self, out: RequestOutput | None, index: int, reason: str, now: float) -> None:
        self.finished.add(index)
        h = self._histograms()
        h.e2e.observe(self._since_arrival(out, "finished_time", now))
        self.m.request_success(self.m.engines.index(h), reason).inc()
        if out is None:
            return
        h.prompt_tokens.observe(len(out.prompt_token_ids or []))
        h.generation_tokens.observe(self.seq_tokens.get(index, 0))
        rm = out.metrics
        if rm is None or rm.first_scheduled_time is None:
            return
        if rm.arrival_time is not None:
            h.queue_time.observe(max(rm.first_scheduled_time - rm.arrival_time, 0.0))
        if rm.first_token_time is not None and rm.last_token_time is not None:
            h.prefill_time.observe(max(rm.first_token_time - rm.first_scheduled_time, 0.0))
            h.decode_time.observe(max(rm.last_token_time - rm.first_token_time, 0.0))
            h.inference_time.observe(max(rm.last_token_time - rm.first_scheduled_time, 0.0))

    def _since_arrival(self, out: RequestOutput | None, event: str, now: float) -> float:
        """Seconds from the request's arrival to now, or with engine_times to the engine's time of event."""
        rm = out.metrics if out is not None and self.engine_times else None
        at = getattr(rm, event, None) if rm is not None else None
        if at is None:
            return now - self.arrival
        return max(at - rm.arrival_time, 0.0)

    def _done(self) -> None:
        self.done = True
        h = self._histograms()
        h.n_param.observe(len(self.finished))  # the request's n: one finish per sequence
        if self.max_tokens:
            h.max_tokens.observe(self.max_tokens)
        h.max_generation_tokens.observe(max(self.seq_tokens.values(), default=0))
