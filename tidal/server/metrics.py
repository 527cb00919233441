"""Prometheus metrics of the API process (`tidal:` prefix, SGLang-like names).

Request counters and latency histograms are measured here, in the API process; the
scheduler gauges are filled from a StatsResp just before each scrape.
"""

from __future__ import annotations

from typing import Iterator, Optional

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily

from tidal.messages import StatsResp

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# gauge name -> StatsResp field
_GAUGES = {
    "num_running_reqs": "num_running_reqs",
    "num_queue_reqs": "num_waiting_reqs",
    "num_used_tokens": "num_used_tokens",
    "max_total_num_tokens": "max_total_tokens",
    "token_usage": "token_usage",
    "cache_hit_rate": "cache_hit_rate",
    "gen_throughput": "gen_throughput",
    "max_decode_batch_size": "max_decode_batch_size",
    "num_retracted_reqs": "num_retracted_total",
    "num_migrated_reqs": "num_migrated_total",
    "spec_accept_length": "spec_accept_length",
    "spec_accept_rate": "spec_accept_rate",
}


class Metrics:
    """One registry per server, so that several apps can live in one process (tests)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self._labels = {"model_name": model_name}
        self.requests = Counter("tidal:num_requests", "Finished requests", labels, registry=r)
        self.aborted = Counter("tidal:num_aborted_requests", "Requests that finished aborted", labels, registry=r)
        self.prompt_tokens = Counter("tidal:prompt_tokens", "Prompt tokens of finished requests", labels, registry=r)
        self.generation_tokens = Counter("tidal:generation_tokens", "Generated tokens", labels, registry=r)
        self.cached_tokens = Counter("tidal:cached_tokens", "Prompt tokens served from the prefix cache", labels, registry=r)
        self.ttft = Histogram("tidal:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("tidal:inter_token_latency_seconds", "Time between output tokens", labels,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("tidal:e2e_request_latency_seconds", "Request latency", labels,
                             buckets=_E2E_BUCKETS, registry=r)
        self.gauges = {name: Gauge(f"tidal:{name}", f"Scheduler {field}", labels, registry=r)
                       for name, field in _GAUGES.items()}
        pd_labels = ["queue", "model_name"]
        self.queue_sizes = Gauge("tidal:queue_size", "Requests per scheduler queue (waiting, running, "
                                 "bootstrap, inflight, prealloc, transfer)", pd_labels, registry=r)
        self.transfer_bytes = Gauge("tidal:kv_transfer_bytes", "KV bytes transferred by this role", labels, registry=r)
        self.failed_bootstraps = Gauge("tidal:kv_failed_bootstraps", "KV transfer bootstraps that failed",
                                       labels, registry=r)
        self.failed_transfers = Gauge("tidal:kv_failed_transfers", "KV transfers that failed", labels, registry=r)
        self.stats_age = Gauge("tidal:scheduler_stats_age_seconds", "Age of the scheduler gauges in this scrape",
                               labels, registry=r)
        self._transfer_latency: tuple[dict, float] = ({}, 0.0)
        r.register(self)
        for m in (self.requests, self.aborted, self.prompt_tokens, self.generation_tokens, self.cached_tokens,
                  self.ttft, self.itl, self.e2e):
            m.labels(**self._labels)  # export zeros before the first request

    def on_first_token(self, seconds: float) -> None:
        self.ttft.labels(**self._labels).observe(seconds)

    def on_tokens(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` arrived `seconds` after the previous output of the request."""
        if num_tokens <= 0:
            return
        per_token = seconds / num_tokens
        h = self.itl.labels(**self._labels)
        for _ in range(num_tokens):
            h.observe(per_token)

    def on_finish(self, prompt: int, completion: int, cached: int, e2e: float, aborted: bool) -> None:
        lab = self._labels
        self.requests.labels(**lab).inc()
        if aborted:
            self.aborted.labels(**lab).inc()
        self.prompt_tokens.labels(**lab).inc(prompt)
        self.generation_tokens.labels(**lab).inc(completion)
        self.cached_tokens.labels(**lab).inc(cached)
        self.e2e.labels(**lab).observe(e2e)

    def set_stats(self, stats: Optional[StatsResp], age_s: float = 0.0) -> None:
        """`age_s`: how long ago the scheduler took these stats."""
        if stats is None:
            return
        self.stats_age.labels(**self._labels).set(age_s)
        for name, field in _GAUGES.items():
            self.gauges[name].labels(**self._labels).set(float(getattr(stats, field)))
        self._set_pd_stats(stats)

    def _set_pd_stats(self, stats: StatsResp) -> None:
        lab = self._labels
        for queue, size in stats.queue_sizes.items():
            self.queue_sizes.labels(queue=queue, **lab).set(size)
        self.transfer_bytes.labels(**lab).set(stats.transfer_bytes)
        self.failed_bootstraps.labels(**lab).set(stats.failed_bootstraps)
        self.failed_transfers.labels(**lab).set(stats.failed_transfers)
        self._transfer_latency = (stats.transfer_latency_histogram, stats.transfer_latency_sum)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        """The KV transfer latency histogram, as the scheduler last reported it."""
        hist, total = self._transfer_latency
        fam = HistogramMetricFamily("tidal:kv_transfer_latency_seconds",
                                    "KV transfer latency (init to success)", labels=["model_name"])
        running, buckets = 0, []
        for le, count in hist.items():
            running += count
            buckets.append((le, running))
        if not buckets or buckets[-1][0] != "+Inf":
            buckets.append(("+Inf", running))
        fam.add_metric([self._labels["model_name"]], buckets, total)
        yield fam

    def render(self) -> bytes:
        return generate_latest(self.registry)
