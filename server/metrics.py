"""Prometheus metrics of the server (one registry per app, so tests can build several apps)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from depthserve.depth import DepthCounter, DepthReport
from depthserve.outputs import RequestMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector:
    """Engine gauges and counters, read at scrape time from the snapshot the engine thread publishes
    after each step (never stale, nothing to keep in sync)."""

    def __init__(self, read_stats: Callable[[], dict]):
        self._read_stats = read_stats

    def collect(self):
        stats = self._read_stats()
        running = GaugeMetricFamily("depthserve_requests_running", "Sequences in the running batch")
        running.add_metric([], stats["num_running"])
        waiting = GaugeMetricFamily("depthserve_requests_waiting", "Sequences waiting for admission")
        waiting.add_metric([], stats["num_waiting"])
        preemptions = CounterMetricFamily("depthserve_preemptions", "Preemptions (recompute) since start")
        preemptions.add_metric([], stats["num_preemptions"])
        pages = GaugeMetricFamily("depthserve_kv_pages_used", "KV cache pages in use")
        pages.add_metric([], stats["kv_pages_used"])
        total = GaugeMetricFamily("depthserve_kv_pages_total", "KV cache pages in the pool")
        total.add_metric([], stats["kv_pages_total"])
        by_kind = GaugeMetricFamily("depthserve_kv_bytes_used", "KV cache bytes in use by cache kind", labels=["kind"])
        for kind, used in stats["kv_bytes_used_by_kind"].items():
            by_kind.add_metric([kind], used)
        queries = CounterMetricFamily("depthserve_prefix_cache_queries",
                                      "Full prompt blocks looked up in the prefix cache since start")
        queries.add_metric([], stats["prefix_cache_queries"])
        hits = CounterMetricFamily("depthserve_prefix_cache_hits", "Prompt blocks found in the prefix cache since start")
        hits.add_metric([], stats["prefix_cache_hits"])
        yield from (running, waiting, preemptions, pages, total, by_kind, queries, hits)
        yield from _depth_policy_metrics(stats)
        if "last_step_cache_bytes_by_kind" in stats:  # caches that live for one step (Dreamer depth cache)
            step_cache = GaugeMetricFamily("depthserve_step_cache_bytes",
                                           "Peak bytes of step-lived caches in the last step, by cache kind",
                                           labels=["kind"])
            for kind, used in stats["last_step_cache_bytes_by_kind"].items():
                step_cache.add_metric([kind], used)
            reserved = GaugeMetricFamily("depthserve_step_cache_reserved_bytes",
                                         "Cache memory set aside for a full step's step-lived caches")
            reserved.add_metric([], stats.get("step_cache_reserved_bytes", 0))
            yield from (step_cache, reserved)


def _depth_policy_metrics(stats: dict):
    """The depth policy's view (docs/depth-semantics.md section 6): the levels tokens of range-knob requests
    ran, as a histogram over levels; tokens run below their range's maximum; the policy's cap."""
    levels = stats.get("depth_levels_run", {})
    histogram = HistogramMetricFamily("depthserve_depth_token_level",
                                      "Levels (Dreamer depth) the tokens of requests with a depth range ran at")
    counts, running = [], 0
    for level in sorted(levels):
        running += levels[level]
        counts.append((str(level), running))
    histogram.add_metric([], counts + [("+Inf", running)], sum_value=sum(k * n for k, n in levels.items()))
    shed = CounterMetricFamily("depthserve_depth_shed_tokens",
                               "Tokens of requests with a depth range run below the range's maximum")
    shed.add_metric([], stats.get("depth_shed_tokens", 0))
    target = GaugeMetricFamily("depthserve_depth_policy_target", "The depth policy's level cap in the last step "
                               "with a depth range (0: none yet)", labels=["policy"])
    target.add_metric([str(stats.get("depth_policy", "fixed"))], stats.get("depth_policy_target") or 0)
    yield from (histogram, shed, target)


class _DepthCounters:
    """`depthserve_depth_counter{model,name,...}`: the typed counts finished requests report
    (DepthReport.counter_samples: loop iterations per layer, tokens routed per layer and step, ...),
    summed per model, counter name and labels. The labels are the architecture's, so one family
    carries every architecture's counters without the server knowing any of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}

    def add(self, model: str, sample: DepthCounter) -> None:
        key = (model, sample.name, sample.labels)
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + sample.value

    def collect(self):
        family = CounterMetricFamily("depthserve_depth_counter",
                                     "Depth work of finished requests, by model, counter name and the counter's labels")
        with self._lock:
            counts = sorted(self._counts.items())
        for (model, name, labels), value in counts:
            family.add_sample("depthserve_depth_counter_total", {"model": model, "name": name, **dict(labels)}, value)
        yield family


class ServerMetrics:
    def __init__(self, read_stats: Callable[[], dict], model: str = "", knobs: Collection[str] = ()):
        """`model`: the served model's name (the depth counters' label); `knobs`: its depth knob names
        (requests are counted by each integer setting of one)."""
        self.model = model
        self.knobs = tuple(knobs)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("depthserve_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("depthserve_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("depthserve_inter_token_latency_seconds", "Time between streamed outputs",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("depthserve_e2e_request_latency_seconds", "Request latency, arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("depthserve_request_queue_seconds", "Arrival to first scheduled (time waiting for admission)",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("depthserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("depthserve_generation_tokens", "Tokens generated", registry=r)
        self.depth_counters = _DepthCounters()
        r.register(self.depth_counters)
        self.depth_flops = Counter("depthserve_depth_flops",
                                   "FLOPs of finished requests on a depth model: spent, and what the plain model "
                                   "would spend on the same tokens (their ratio is the served relative compute)",
                                   ["kind"], registry=r)
        self.depth_settings = Counter("depthserve_depth_requests_by_setting",
                                      "Finished requests by the integer setting of a depth knob",
                                      ["knob", "value"], registry=r)
        r.register(_EngineCollector(read_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def record_depth(self, depth: DepthReport | None) -> None:
        """Add a finished request's depth usage (RequestOutput.depth) to the depth counters."""
        if depth is None:
            return
        for sample in depth.counter_samples:
            self.depth_counters.add(self.model, sample)
        self.depth_flops.labels(kind="spent").inc(depth.flops)
        self.depth_flops.labels(kind="plain").inc(depth.plain_flops)
        for knob in self.knobs:
            value = depth.settings.get(knob)
            if isinstance(value, int) and not isinstance(value, bool):
                self.depth_settings.labels(knob=knob, value=str(value)).inc()


class RequestTimer:
    """Per-request latency bookkeeping, fed with each engine output as it arrives."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.queued = False

    def on_output(self, num_new_tokens: int, engine_times: RequestMetrics | None = None) -> None:
        now = time.monotonic()
        if not self.queued and engine_times is not None and engine_times.queue_time is not None:
            self.queued = True
            self.metrics.queue.observe(engine_times.queue_time)
        if num_new_tokens <= 0:
            return
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
        elif self.last is not None:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def finish(self, outcome: str, prompt_tokens: int, generated_tokens: int) -> None:
        self.metrics.requests.labels(outcome=outcome).inc()
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generation_tokens.inc(generated_tokens)
