"""What the router adds to a request's latency: the same requests sent straight to a worker and through a
`tidal router`, interleaved one for one, against stub workers that answer at once (so the difference is the
router's: parsing, routing, the upstream call(s), relaying). Paths: whole (one null worker), pd (a prefill and
a decode stub, dual dispatch), and whole with the admission gate on.

    python -m tidal.bench.router_overhead --requests 2000

Prints p50 and p99 of each side and of the paired difference, per path, as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import httpx
import numpy as np

from tidal.bench.procs import serving


def _stub_app(mode: str):
    from fastapi import FastAPI
    from starlette.responses import Response

    app = FastAPI()
    answer = json.dumps({"text": "ok", "output_ids": [1, 2, 3],
                         "meta_info": {"prompt_tokens": 4, "completion_tokens": 3,
                                       "finish_reason": {"type": "length", "length": 3}}}).encode()

    @app.post("/generate")
    async def generate() -> Response:
        return Response(answer, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/server_info")
    async def server_info() -> Response:
        return Response(json.dumps({"disaggregation_mode": mode, "epoch": 0}), media_type="application/json")

    @app.get("/get_load")
    async def get_load() -> Response:
        return Response(b'[{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]',
                        media_type="application/json")

    return app


def serve_stub(port: int, mode: str) -> None:
    import uvicorn

    uvicorn.run(_stub_app(mode), host="127.0.0.1", port=port, log_level="error")


def _process(cmd: list[str], health: str):
    return serving(cmd, health.removesuffix("/health"), timeout_s=60)


def _stub(port: int, mode: str):
    return _process([sys.executable, "-m", "tidal.bench.router_overhead", "--stub", mode, "--port", str(port)],
                    f"http://127.0.0.1:{port}/health")


def _router(port: int, workers: list[str]):
    return _process([sys.executable, "-m", "tidal.cli", "router", "--port", str(port), "--log-level", "warning",
                     *workers], f"http://127.0.0.1:{port}/health")


def _measure(direct: str, routed: str, n: int, warmup: int) -> dict:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 3}}
    lat: dict[str, list[float]] = {"direct": [], "router": []}
    with httpx.Client(timeout=30) as client:
        for i in range(warmup + n):
            for side, url in (("direct", direct), ("router", routed)) if i % 2 else (("router", routed),
                                                                                      ("direct", direct)):
                t0 = time.perf_counter()
                r = client.post(url + "/generate", json=body)
                dt = time.perf_counter() - t0
                if r.status_code != 200:
                    raise RuntimeError(f"{side}: HTTP {r.status_code}: {r.text[:200]}")
                if i >= warmup:
                    lat[side].append(dt)
    diff = [b - a for a, b in zip(lat["direct"], lat["router"])]
    def ms(xs: list[float], q: float) -> float:
        return round(1000 * float(np.percentile(xs, q)), 3)

    return {"requests": n, "direct_p50_ms": ms(lat["direct"], 50), "direct_p99_ms": ms(lat["direct"], 99),
            "router_p50_ms": ms(lat["router"], 50), "router_p99_ms": ms(lat["router"], 99),
            "added_p50_ms": ms(diff, 50), "added_p99_ms": ms(diff, 99),
            "added_mean_ms": round(1000 * statistics.fmean(diff), 3)}


def run(n: int, warmup: int, base_port: int) -> list[dict]:
    w1, w2, w3, r = base_port, base_port + 1, base_port + 2, base_port + 3
    out = []
    with _stub(w1, "null"), _stub(w2, "prefill"), _stub(w3, "decode"):
        paths = {"whole": ["--worker", f"http://127.0.0.1:{w1}"],
                 "pd": ["--prefill", f"http://127.0.0.1:{w2}", "none", "--decode", f"http://127.0.0.1:{w3}"],
                 "whole+admission": ["--worker", f"http://127.0.0.1:{w1}", "--max-concurrent-requests", "64"]}
        for path, flags in paths.items():
            direct = f"http://127.0.0.1:{w3 if path == 'pd' else w1}"
            with _router(r, flags):
                out.append({"path": path, **_measure(direct, f"http://127.0.0.1:{r}", n, warmup)})
            print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tidal.bench.router_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="measured requests per side and path")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--base-port", type=int, default=18610, help="the stubs' and the router's ports (4 from here)")
    ap.add_argument("--stub", choices=("null", "prefill", "decode"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.stub:
        serve_stub(args.port, args.stub)
        return
    run(args.requests, args.warmup, args.base_port)


if __name__ == "__main__":
    main()
