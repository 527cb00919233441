"""KV cache events: what each server's prefix cache stored and removed, published over ZMQ for a router to keep
an exact per-worker prefix index (SGLang's `--kv-events-config`, vLLM's event shapes).

- `events.py`: the event structs, the chained block hash both sides compute, and the config;
- `publisher.py`: the server side (a PUB socket, a replay socket, a bounded buffer of batches);
- `subscriber.py`: the router side (a per-worker subscription that replays what it missed, and the index).
"""
