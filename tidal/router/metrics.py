"""Prometheus metrics of the router (`tidal_router:` prefix), one registry per router."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from tidal.router.workers import WorkerRegistry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        wl = ["worker", "role"]
        self.requests = Counter("tidal_router:requests", "Client requests by route and outcome",
                                ["route", "status"], registry=r)
        self.worker_requests = Counter("tidal_router:worker_requests", "Requests sent to a worker", wl, registry=r)
        self.worker_failures = Counter("tidal_router:worker_failures",
                                       "Requests to a worker that failed (5xx, 408, 429, connection, timeout)",
                                       wl, registry=r)
        self.retries = Counter("tidal_router:retries", "Retries caused by a worker's failure", wl, registry=r)
        self.breaker_transitions = Counter("tidal_router:circuit_breaker_transitions",
                                           "A worker's circuit breaker changing state, by the state it entered",
                                           ["worker", "role", "state"], registry=r)
        self.admission_refused = Counter("tidal_router:admission_refused",
                                         "Requests refused by the admission gate: 429 queue full, 408 queue timeout",
                                         ["status"], registry=r)
        self.admission_active = Gauge("tidal_router:admission_active", "Requests holding an admission slot",
                                      registry=r)
        self.admission_queued = Gauge("tidal_router:admission_queued", "Requests waiting for an admission slot",
                                      registry=r)
        self.healthy = Gauge("tidal_router:worker_healthy", "1 if the worker passed its last checks", wl, registry=r)
        self.in_flight = Gauge("tidal_router:worker_in_flight", "Requests the router has open on the worker",
                               wl, registry=r)
        self.planner_moves = Counter("tidal_router:planner_moves", "Role moves the planner started, by outcome",
                                     ["from", "to", "outcome"], registry=r)
        self.hand_moves = Counter("tidal_router:hand_moves",
                                  "Role moves by hand, by outcome and route: through the router's "
                                  "/admin/set_worker_role, or on the worker's own switch route (found by the "
                                  "health check)", ["from", "to", "outcome", "route"], registry=r)
        self.planner_decisions = Counter("tidal_router:planner_decisions",
                                         "Planner decisions by kind (move, hold, advise)", ["kind"], registry=r)
        pool = ["pool"]
        self.planner_predicted_ttft = Gauge("tidal_router:planner_predicted_ttft_seconds",
                                            "Planner's predicted TTFT of the current pools, by pool", pool, registry=r)
        self.planner_predicted_tpot = Gauge("tidal_router:planner_predicted_tpot_seconds",
                                            "Planner's predicted TPOT of the current pools, by pool", pool, registry=r)
        self.planner_observed_ttft = Gauge("tidal_router:planner_observed_ttft_seconds",
                                           "Mean TTFT of the requests the router timed over the planner's window, "
                                           "by pool",
                                           pool, registry=r)
        self.planner_observed_tpot = Gauge("tidal_router:planner_observed_tpot_seconds",
                                           "Mean TPOT of the requests the router timed over the planner's window, "
                                           "by pool",
                                           pool, registry=r)

    def render(self, workers: WorkerRegistry) -> bytes:
        self.healthy.clear()
        self.in_flight.clear()
        for w in workers.all():
            self.healthy.labels(w.url, w.mode).set(1.0 if w.healthy else 0.0)
            self.in_flight.labels(w.url, w.mode).set(w.in_flight)
        return generate_latest(self.registry)
