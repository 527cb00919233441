"""One upstream call (a `Leg`) and the response that relays a stream to the client."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import aiohttp
import msgspec
from multidict import CIMultiDict, CIMultiDictProxy
from starlette.responses import Response

from tidal.router.metrics import RouterMetrics
from tidal.router.resilience import FAILURE, NEUTRAL, SUCCESS, CircuitBreakers, parse_retry_after
from tidal.router.workers import Worker, WorkerRegistry
from tidal.server.protocol import error_body
from tidal.server_timing import HEADER as SERVER_TIMING

logger = logging.getLogger(__name__)

# 409: the worker changed role since we picked it (X-Tidal-Expected-Mode); go elsewhere
RETRYABLE_STATUS = frozenset({408, 409, 429} | set(range(500, 600)))
# the answers that say the worker itself is broken, for its circuit breaker; a refusal says it works (4xx; 503:
# draining for a switch or full; 409: it moved)
BREAKER_FAILURE_STATUS = frozenset({408} | set(range(500, 600))) - {503}
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def stream_refusal(first: bytes) -> Optional[tuple[int, bytes]]:
    """(status, error JSON) when a stream's first event is a retryable error: a tidal server answers a stream
    200 at once, and a refusal its scheduler decides (a worker that changed role since the router picked it, 409;
    one draining for a switch, 503) comes as the stream's only event. Nothing was generated, so the request can
    go elsewhere as a refusal by status would; None for anything else."""
    if not first.startswith(b'data: {"error"'):  # a server's error event leads with it; any other stream goes on
        return None
    event = first[len(b"data: "):].split(b"\n", 1)[0]
    try:
        err = msgspec.json.decode(event).get("error")
    except (msgspec.DecodeError, AttributeError):
        return None
    code = err.get("code") if isinstance(err, dict) else None
    if not isinstance(code, int) or code not in RETRYABLE_STATUS:
        return None
    return code, event


def json_error(message: str, status_code: int) -> Response:
    return Response(msgspec.json.encode(error_body(message, status_code)), status_code=status_code,
                    media_type="application/json")


class Leg:
    """A POST to one worker. Holds the worker's in-flight count until `close()`.

    `run(stream=True)` leaves a 2xx response open with its first body chunk in `body`;
    every other outcome is read whole (or recorded as `error`) and closed.
    """

    def __init__(self, worker: Worker, role: str, session: aiohttp.ClientSession, registry: WorkerRegistry,
                 metrics: RouterMetrics, url: str, data: bytes, req_headers: dict, timeout_s: float,
                 breakers: Optional[CircuitBreakers] = None) -> None:
        self.worker = worker
        self.role = role
        self.session = session
        self.registry = registry
        self.metrics = metrics
        self.url = url
        self.data = data
        self.req_headers = req_headers
        self.timeout_s = timeout_s
        self.status: Optional[int] = None
        self.headers: CIMultiDictProxy = CIMultiDictProxy(CIMultiDict())  # the worker's, once it answers
        self.body = b""
        self.error: Optional[str] = None
        self.timed_out = False
        self._resp: Optional[aiohttp.ClientResponse] = None
        self._active = False
        # the worker is claimed from its circuit breaker now, between the route's plan and any wait
        self.breakers = breakers
        self._probe = breakers.claim(worker.url) if breakers is not None else False
        self._settled = breakers is None
        self._verdict_held = False  # close() leaves the breaker to the owner (see hold_verdict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.status is not None and 200 <= self.status < 300

    @property
    def retryable(self) -> bool:
        if self.error is not None:
            return not self.timed_out
        return self.status in RETRYABLE_STATUS

    def describe(self) -> str:
        where = f"{self.role} worker {self.worker.url}"
        if self.error is not None:
            return f"{where}: {self.error}"
        detail = self.body[:300].decode("utf-8", "replace").strip()
        return f"{where}: HTTP {self.status}" + (f": {detail}" if detail else "")

    def verdict(self) -> str:
        """What this call says of the worker, for its circuit breaker."""
        if self.ok:
            return SUCCESS
        if self.error is not None or self.status in BREAKER_FAILURE_STATUS:
            return FAILURE
        return NEUTRAL  # a refusal, or never answered (cancelled)

    def settle(self, verdict: Optional[str] = None) -> None:
        """Tell the worker's breaker how the call went, once (`verdict` overrides what the call says: the
        dispatcher's NEUTRAL for a decode leg that failed because its prefill did)."""
        if not self._settled:
            self._settled = True
            self.breakers.record(self.worker.url, verdict or self.verdict(), self._probe)

    def hold_verdict(self) -> None:
        """The call's end does not settle its breaker: the owner settles it, once it knows whose failure it was
        (a decode leg that fails because its prefill did is not charged, whichever task ends first)."""
        self._verdict_held = True

    def release_verdict(self) -> None:
        self._verdict_held = False
        if not self._active:
            self.settle()

    def retry_after_s(self) -> Optional[float]:
        return parse_retry_after(self.headers.get("retry-after"))

    def client_status(self) -> int:
        if self.status is not None:
            return self.status
        return 504 if self.timed_out else 502

    def relayed_headers(self) -> Optional[dict]:
        """The worker's headers a whole answer passes on: its Server-Timing lines (the server's TTFT and TPOT),
        joined; none that is not ASCII (a worker's stray byte must not turn its good answer into a 500)."""
        timing = ", ".join(self.headers.getall(SERVER_TIMING, ()))
        return {SERVER_TIMING: timing} if timing and timing.isascii() else None

    def passthrough(self) -> Response:
        return Response(self.body, status_code=self.status or 502,
                        media_type=self.headers.get("content-type", "application/json"),
                        headers=self.relayed_headers())

    # ------------------------------------------------------------ the call

    async def run(self, stream: bool) -> None:
        self._active = True
        self.registry.begin(self.worker)
        self.metrics.worker_requests.labels(self.worker.url, self.role).inc()
        try:
            await asyncio.wait_for(self._send(stream), self.timeout_s)
        except aiohttp.ConnectionTimeoutError as e:
            self._fail(f"connect timeout: {e}", conn=True)
        except TimeoutError:  # aiohttp's read timeout or wait_for's
            self.timed_out = True
            self._fail(f"no answer within {self.timeout_s:g} s", conn=False)
        except aiohttp.ClientError as e:
            self._fail(f"{type(e).__name__}: {e}", conn=True)
        except BaseException:
            self.close()
            raise
        if not (stream and self.ok):
            self.close()
        if self.ok:
            self.registry.record_request_ok(self.worker)
        elif self.error is None and self.status in RETRYABLE_STATUS:
            self.metrics.worker_failures.labels(self.worker.url, self.role).inc()

    async def _send(self, stream: bool) -> None:
        resp = self._resp = await self.session.post(self.url, data=self.data, headers=self.req_headers)
        self.status, self.headers = resp.status, resp.headers
        if stream and 200 <= resp.status < 300:
            self.body = await resp.content.readany()
            refusal = stream_refusal(self.body)
            if refusal is not None:
                self.status, self.body = refusal
        else:
            self.body = await resp.read()

    def _fail(self, reason: str, conn: bool) -> None:
        self.error = reason
        self.metrics.worker_failures.labels(self.worker.url, self.role).inc()
        if conn:
            self.registry.record_failure(self.worker, reason)
        logger.warning("%s", self.describe())

    @property
    def rest(self) -> Optional[AsyncIterator[bytes]]:
        """An open stream's body after the first chunk, byte for byte."""
        return self._resp.content.iter_any() if self._resp is not None else None

    def close(self) -> None:
        """Release the worker; an unfinished response is closed with its connection (the worker sees it)."""
        if not self._verdict_held:
            self.settle()
        if self._active:
            self._active = False
            self.registry.end(self.worker)
        resp, self._resp = self._resp, None
        if resp is not None:
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class RelayResponse(Response):
    """Relays an open upstream stream to the client as it arrives.

    When the client disconnects the upstream response is closed (the worker sees the
    disconnect and aborts) and `on_done(prefill_task, completed=False)` runs.
    """

    def __init__(self, leg: Leg, prefill_task: Optional[asyncio.Task],
                 on_done: Callable[[Optional[asyncio.Task], bool], Awaitable[None]]) -> None:
        self.leg = leg
        self.prefill_task = prefill_task
        self.on_done = on_done
        self.tally: Any = None  # fed every chunk when set (the planner's StreamTally)
        self.on_end: Optional[Callable[[bool], None]] = None  # called with `completed` when the relay ends
        self.finalizers: list[Callable[[], None]] = []  # called when the relay ends, however it ends
        self.status_code = leg.status or 200
        self.media_type = leg.headers.get("content-type", "text/event-stream")
        self.background = None
        self.init_headers(SSE_HEADERS)  # no body attribute: no content-length

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        completed = False
        try:
            done, _ = await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
            completed = pump in done and not pump.cancelled() and pump.exception() is None
        finally:
            for t in (pump, gone):
                t.cancel()
            await asyncio.gather(pump, gone, return_exceptions=True)
            self.leg.close()
            for fin in self.finalizers:
                fin()
            if self.on_end is not None:
                self.on_end(completed)
            await self.on_done(self.prefill_task, completed)

    def discard(self) -> None:
        """Release what the relay holds without sending it (its client left before it started)."""
        self.leg.close()
        for fin in self.finalizers:
            fin()
        if self.on_end is not None:
            self.on_end(False)
        if self.prefill_task is not None:
            self.prefill_task.cancel()

    def _tally(self, chunk: bytes) -> None:
        if self.tally is not None:
            self.tally.feed(chunk)

    async def _pump(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if self.leg.body:
            self._tally(self.leg.body)
            await send({"type": "http.response.body", "body": self.leg.body, "more_body": True})
        try:
            if self.leg.rest is not None:
                async for chunk in self.leg.rest:
                    self._tally(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except aiohttp.ClientError as e:
            self.leg._fail(f"stream broke: {type(e).__name__}: {e}", conn=not isinstance(e, TimeoutError))
            err = error_body(f"upstream {self.leg.describe()}", 502)
            await send({"type": "http.response.body", "body": b"data: " + msgspec.json.encode(err) + b"\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
