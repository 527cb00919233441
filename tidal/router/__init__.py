"""The PD-aware router (`tidal router`): prefill/decode dual dispatch, whole-request
workers, health checks, load-balancing policies and retries.

Modules: `config` (RouterConfig), `workers` (Worker, WorkerRegistry, HealthChecker),
`policies`, `legs` (one upstream call, stream relay), `dispatch` (Dispatcher),
`app` (create_router_app), `cli` (add_router_args, run_router).
"""
