"""A mock tidal/SGLang worker for router tests: a real uvicorn server in a background thread.

Roles: "prefill" answers like a prefill server (meta_info only, prompt logprobs when
asked), "decode" and "null" answer with text/output_ids/meta_info. Every generation
request is recorded. Knobs (set them from the test thread): `fail_next` (answer the
next N generation requests with `fail_status`), `reject` (answer 400), `hang_s`
(sleep before answering), `healthy` (/health status), `load` (/get_load),
`chunk_delay_s` and `num_chunks` (streaming), `fail_switch` (answer role switches with 500),
`switch_refusal` (answer them with this status and body); otherwise a switch changes `role` and
bumps `epoch`, counted in `switches`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, AsyncIterator, Optional

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from servers import free_port

GENERATE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")

# The KV "transfer" between mocks in this process: bootstrap_room -> "ok" | "failed", set
# by a prefill mock when it answers. A decode mock given rooms waits for them like a real
# decode server waits for its KV, and fails when the transfer failed or never came.
ROOMS: dict[int, str] = {}
KV_WAIT_S = 2.0


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _batch(body: dict) -> Optional[int]:
    if isinstance(body.get("text"), list):
        return len(body["text"])
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def _item(value: Any, i: Optional[int]) -> Any:
    return value[i] if i is not None and isinstance(value, list) else value


def _rooms(body: dict) -> list[int]:
    room = body.get("bootstrap_room")
    if room is None:
        return []
    return list(room) if isinstance(room, list) else [room]


class MockWorker:
    def __init__(self, role: str = "null", name: Optional[str] = None) -> None:
        self.role = role
        self.name = name or role
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests: list[tuple[str, dict]] = []
        self.fail_next = 0
        self.fail_status = 503
        self.fail_headers: Optional[dict] = None  # headers of those failed answers (a Retry-After)
        self.reject = False
        self.hang_s = 0.0
        self.healthy = True
        self.load = {"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
        self.num_chunks = 3
        self.chunk_delay_s = 0.0
        self.cancelled = 0  # streams the client (the router) walked away from
        # the next streams answered as a tidal server whose scheduler refuses them: 200, one 409 event
        self.stream_refusals = 0
        self.health_checks = 0
        self.flushes = 0
        self.epoch = 0
        self.boot_id: Optional[str] = None  # /server_info's, when set (a tidal server's: new at each start)
        self.switches = 0  # role switch requests, failed ones included
        self.fail_switch = False
        self.switch_refusal: Optional[tuple[int, dict]] = None  # (status, body) answered to every role switch
        self.switch_body: Optional[dict] = None  # the last role switch asked for
        self.switch_delay_s = 0.0  # before answering a role switch
        self.load_delay_s = 0.0  # before answering /get_load
        self.openai_answers = False  # whole OpenAI answers shaped as a tidal server's: `usage`, no meta_info
        self.server_timing: Optional[str] = None  # a Server-Timing header on every whole answer
        self._server: Optional[uvicorn.Server] = None
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "MockWorker":
        config = uvicorn.Config(self.app(), host="127.0.0.1", port=self.port, log_level="error",
                                lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.time() + 10
        while not self._server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"mock worker {self.name} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.hang_s = 0.0
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = None

    def reset(self) -> None:
        self.requests.clear()
        self.fail_next, self.reject, self.hang_s, self.healthy = 0, False, 0.0, True
        self.fail_status, self.fail_headers = 503, None
        self.num_chunks, self.chunk_delay_s, self.cancelled = 3, 0.0, 0
        self.openai_answers, self.server_timing = False, None
        self.fail_switch, self.switch_refusal = False, None
        self.switch_delay_s = self.load_delay_s = 0.0
        self.stream_refusals = 0

    def generate_requests(self) -> list[dict]:
        return [b for _, b in self.requests]

    # ------------------------------------------------------------ responses

    def _one(self, body: dict, i: Optional[int]) -> dict:
        room = _item(body.get("bootstrap_room"), i)
        meta: dict = {"id": f"{self.name}-{len(self.requests)}", "prompt_tokens": 4,
                      "completion_tokens": 1 if self.role == "prefill" else 3,
                      "finish_reason": {"type": "length", "length": 3}, "worker": self.name, "room": room}
        if _item(body.get("return_logprob"), i):
            if self.role == "prefill":
                meta["input_token_logprobs"] = [[None, 11, None], [-0.5, 12, None], [-0.25, 13, None]]
                meta["input_top_logprobs"] = [None, [[-0.5, 12, None]], [[-0.25, 13, None]]]
            else:
                meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[-0.1, 7, None]]
        if self.role == "prefill":
            return {"text": "", "output_ids": [7], "meta_info": meta}
        meta.update(first_token_latency=0.01, e2e_latency=0.03)  # the server's own clock: 10 ms a token
        return {"text": f"{self.name} says hi", "output_ids": [7, 8, 9], "meta_info": meta}

    def stream_bytes(self, path: str, body: dict) -> list[bytes]:
        """The exact chunks a stream answer to `body` is made of."""
        out = []
        for k in range(self.num_chunks):
            if path == "/generate":
                out.append(sse({"text": f"{self.name}-{k}", "output_ids": [k],
                                "meta_info": {"room": body.get("bootstrap_room"), "worker": self.name}}))
            else:
                out.append(sse({"id": "cmpl-1", "object": "chat.completion.chunk",
                                "choices": [{"index": 0, "delta": {"content": f"{self.name}-{k}"}}]}))
        return out + [b"data: [DONE]\n\n"]

    async def _stream(self, path: str, body: dict) -> AsyncIterator[bytes]:
        try:
            for chunk in self.stream_bytes(path, body):
                yield chunk
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1
            raise

    async def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and self.hang_s:
            await asyncio.sleep(0.02)

    async def _wait_kv(self, rooms: list[int]) -> bool:
        end = time.monotonic() + KV_WAIT_S
        while time.monotonic() < end:
            states = [ROOMS.get(r) for r in rooms]
            if "failed" in states:
                return False
            if all(st == "ok" for st in states):
                return True
            await asyncio.sleep(0.005)
        return False

    def _error(self, body: dict, message: str, status: int, headers: Optional[dict] = None) -> Response:
        if self.role == "prefill":
            for r in _rooms(body):
                ROOMS[r] = "failed"
        return JSONResponse({"error": {"message": message, "code": status}}, status_code=status, headers=headers)

    async def handle(self, path: str, request: Request) -> Response:
        body = json.loads(await request.body())
        self.requests.append((path, body))
        if self.hang_s:
            await self._sleep(self.hang_s)
        if self.reject:
            return self._error(body, "bad request from mock", 400)
        if self.fail_next > 0:
            self.fail_next -= 1
            return self._error(body, f"{self.name} overloaded", self.fail_status, self.fail_headers)
        if self.role == "prefill":
            ROOMS.update((r, "ok") for r in _rooms(body))
        elif _rooms(body) and not await self._wait_kv(_rooms(body)):
            return self._error(body, f"{self.name}: KV transfer failed", 500)
        if body.get("stream") and self.role != "prefill" and self.stream_refusals > 0:
            self.stream_refusals -= 1
            refusal = {"error": {"message": f"the server is in prefill mode (epoch {self.epoch + 1}), not {self.role}",
                                 "type": "ConflictError", "code": 409}}
            return StreamingResponse(iter([sse(refusal), b"data: [DONE]\n\n"]), media_type="text/event-stream")
        if body.get("stream") and self.role != "prefill":
            return StreamingResponse(self._stream(path, body), media_type="text/event-stream")
        headers = {"server-timing": self.server_timing} if self.server_timing else None
        if self.openai_answers and path != "/generate" and self.role != "prefill":
            return JSONResponse({"id": f"{self.name}-{len(self.requests)}", "object": "text_completion",
                                 "choices": [{"index": 0, "text": f"{self.name} says hi", "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}},
                                headers=headers)
        n = _batch(body) if path == "/generate" else None
        if n is None:
            return JSONResponse(self._one(body, None), headers=headers)
        return JSONResponse([self._one(body, i) for i in range(n)], headers=headers)

    # ------------------------------------------------------------ the app

    def app(self) -> FastAPI:
        app = FastAPI()
        for path in GENERATE_PATHS:
            app.add_api_route(path, self._route(path), methods=["POST"])

        @app.get("/health")
        async def health() -> Response:
            self.health_checks += 1
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/health_generate")
        async def health_generate() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/get_load")
        async def get_load() -> Response:
            await asyncio.sleep(self.load_delay_s)
            return JSONResponse([{"dp_rank": 0, **self.load}])

        @app.get("/server_info")
        async def server_info() -> Response:
            info = {"disaggregation_mode": self.role, "epoch": self.epoch, "name": self.name}
            return JSONResponse(info if self.boot_id is None else {**info, "boot_id": self.boot_id})

        @app.post("/admin/switch_disaggregation_mode")
        async def switch(request: Request) -> Response:
            self.switches += 1
            self.switch_body = json.loads(await request.body())
            await asyncio.sleep(self.switch_delay_s)
            mode = self.switch_body["mode"]
            if self.switch_refusal is not None:
                return JSONResponse(self.switch_refusal[1], status_code=self.switch_refusal[0])
            if self.fail_switch:
                return JSONResponse({"status": "error", "message": f"{self.name} refuses to switch",
                                     "current_mode": self.role, "epoch": self.epoch}, status_code=500)
            if mode == self.role:  # as a tidal server: no switch, the epoch stays
                return JSONResponse({"status": "ok", "current_mode": self.role, "epoch": self.epoch,
                                     "message": f"already in {mode} mode"})
            self.role, self.epoch = mode, self.epoch + 1
            return JSONResponse({"status": "ok", "current_mode": self.role, "epoch": self.epoch,
                                 "timings_ms": {"drain": 0.0, "switch": 1.5}, "message": f"switched to {mode}"})

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "mock-model", "object": "model"}]})

        @app.post("/flush_cache")
        async def flush_cache() -> Response:
            self.flushes += 1
            return JSONResponse({"success": True})

        return app

    def _route(self, path: str) -> Any:
        async def route(request: Request) -> Response:
            return await self.handle(path, request)

        route.__name__ = "mock_" + path.strip("/").replace("/", "_")
        return route
