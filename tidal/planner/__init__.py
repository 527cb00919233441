"""The planner: moves workers between the null, prefill and decode pools with the traffic.

- schema.py: the snapshots, predictions and decisions (msgspec Structs);
- window.py: the sliding window of what the router observes (arrivals, lengths, TTFT, TPOT);
- predict.py: next-interval TTFT/TPOT for a pool layout (cost model, or observed latencies);
- decide.py: the pure decision (clock injected: `decide(now, ...)`), cooldowns, backoff;
- loop.py: the router's asyncio shell around it, `/planner/status`, metrics.
"""
