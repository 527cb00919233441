"""Request dispatch: PD dual dispatch, whole-request proxying, retries and streaming.

PD: one prefill and one decode worker are picked, the same JSON (with
`bootstrap_host/port/room` injected) is POSTed to both at once, and the client gets
the decode worker's answer. Nothing is sent to the client before the decode worker's
first body bytes arrive, so until then any retryable failure of either side (408,
429, 5xx, connection error) is retried on a new pair with a new room.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, Awaitable, Callable, Optional, Union

import aiohttp
import msgspec
from starlette.responses import Response

from tidal.config import ServerArgs
from tidal.planner.schema import NULL_PATH, PD_PATH
from tidal.planner.window import InFlight, StreamTally, stream_observation, whole_observation
from tidal.router.config import RouterConfig
from tidal.router.legs import Leg, RelayResponse, json_error
from tidal.router.metrics import RouterMetrics
from tidal.router.policies import Policy, PromptTokens, plan_route
from tidal.router.resilience import NEUTRAL, CircuitBreakers, RetryPolicy
from tidal.router.workers import DECODE, MODES, PREFILL, Worker, WorkerRegistry
from tidal.server_timing import HEADER as SERVER_TIMING

logger = logging.getLogger(__name__)

LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
MAX_AFFINITY_CHARS = 16384
# the most generation requests the planner's window counts for one body: what the servers' default limits allow
MAX_COUNTED_REQUESTS = ServerArgs.max_n * ServerArgs.max_batch_size_per_request
_ROOM_RNG = random.SystemRandom()


EXPECTED_MODE_HEADER = "X-Tidal-Expected-Mode"
# a decode worker fails its request soon after the prefill worker fails it (its KV never comes): a failed decode leg
# waits this long for the prefill leg's answer, which names the cause (a prefill 400 is not retried)
ROOT_CAUSE_WAIT_S = 1.0


def new_room() -> int:
    return _ROOM_RNG.randint(0, 2**63 - 1)


def batch_size(route: str, body: dict) -> Optional[int]:
    """Items in a batched /generate (`text` or `input_ids` lists), None for one prompt."""
    if route != "/generate":
        return None
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def requests_in(route: str, body: dict) -> int:
    """The generation requests one body makes, as the server counts them (the planner's arrivals): a
    batched /generate's items, each times its `sampling_params.n`; an OpenAI completion's prompts times
    `n`; a chat's `n`. At most MAX_COUNTED_REQUESTS: a body past the servers' limits is refused, and the
    count must not cost the router memory in proportion to a number the client wrote."""
    if route == "/generate":
        items = batch_size(route, body) or 1
        sp = body.get("sampling_params")
        per_item = sp[:items] if isinstance(sp, list) else [sp] * items
        count = sum(_samples(p.get("n") if isinstance(p, dict) else None) for p in per_item)
    else:
        prompts = 1
        prompt = body.get("prompt")
        if (not route.endswith("/chat/completions") and isinstance(prompt, list) and prompt
                and not all(isinstance(x, int) for x in prompt)):
            prompts = len(prompt)  # a list of prompts (strings or token lists), not one prompt's token ids
        count = prompts * _samples(body.get("n"))
    return max(1, min(count, MAX_COUNTED_REQUESTS))


def _samples(n: Any) -> int:
    return min(n, MAX_COUNTED_REQUESTS) if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


def inject_bootstrap(body: dict, route: str, prefill: Worker) -> dict:
    host, port = prefill.host, prefill.bootstrap_port
    out = dict(body)
    n = batch_size(route, body)
    if n is None:
        out.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=new_room())
    else:
        out.update(bootstrap_host=[host] * n, bootstrap_port=[port] * n,
                   bootstrap_room=[new_room() for _ in range(n)])
    return out


def _flatten(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(x, int) for x in value):
            return ",".join(map(str, value))
        return _flatten(value[0])  # a batch: its first item
    return ""


def _chat_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role', '')}\n{content if isinstance(content, str) else ''}\n")
    return "".join(parts)


def request_text(route: str, body: dict) -> str:
    """The text cache-aware routing keys on (a prefix of it)."""
    if route == "/generate":
        text = _flatten(body.get("text") if body.get("text") is not None else body.get("input_ids"))
    elif route.endswith("/chat/completions"):
        text = _chat_text(body.get("messages"))
    else:
        text = _flatten(body.get("prompt"))
    return text[:MAX_AFFINITY_CHARS]


def wants_logprobs(body: dict) -> bool:
    v = body.get("return_logprob")
    return any(v) if isinstance(v, list) else bool(v)


def merge_logprobs(decode_out: Any, prefill_out: Any) -> bool:
    """Prepend prefill's prompt logprobs to decode's meta_info (per batch item); True if any merged."""
    if isinstance(decode_out, list) and isinstance(prefill_out, list):
        pairs = list(zip(decode_out, prefill_out))
    else:
        pairs = [(decode_out, prefill_out)]
    merged = False
    for d, p in pairs:
        dm = d.get("meta_info") if isinstance(d, dict) else None
        pm = p.get("meta_info") if isinstance(p, dict) else None
        if not isinstance(dm, dict) or not isinstance(pm, dict):
            continue
        for key in LOGPROB_KEYS:
            if isinstance(pm.get(key), list):
                own = dm.get(key)
                dm[key] = pm[key] + (own if isinstance(own, list) else [])
                merged = True
    return merged


class Failure:
    """A failed attempt: what the client gets if it is not (or can no longer be) retried."""

    def __init__(self, leg: Leg, retryable: bool, other: Optional[Leg] = None) -> None:
        self.leg = leg
        self.retryable = retryable
        self.other = other  # the partner leg, when it failed too

    def response(self) -> Response:
        leg, other = self.leg, self.other
        if other is not None and not (leg.status is not None and 400 <= leg.status < 500):
            msg = f"{leg.describe()}; {other.describe()}"
            return json_error(msg, leg.client_status())
        if leg.status is not None and leg.body:
            return Response(leg.body, status_code=leg.status,
                            media_type=leg.headers.get("content-type", "application/json"))
        return json_error(leg.describe(), leg.client_status())


Outcome = Union[Response, Failure]


class Dispatcher:
    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry, policies: dict[str, Policy],
                 session: aiohttp.ClientSession, metrics: RouterMetrics, observer: Any = None) -> None:
        self.cfg = cfg
        # the planner's TrafficWindow: arrival(now, requests) -> ticket, completion(now, Observation, ticket, requests),
        # forget(ticket), withdraw(arrived_at, requests)
        self.observer = observer
        self.registry = registry
        self.policies = policies  # per pool: PREFILL, DECODE, NULL
        self.session = session
        self.metrics = metrics
        self.retry = cfg.retry_policy()
        self._rng = random.Random()
        self.breakers = CircuitBreakers(cfg.breaker_config(), on_change=self._breaker_changed)
        registry.on_remove(self.breakers.forget)
        self._background: set[asyncio.Task] = set()
        # kv_aware: (route, body) -> the prompt's PromptTokens, None when they cannot be had
        self.tokenize: Optional[Callable[[str, dict], Awaitable[Optional[PromptTokens]]]] = None
        self._wants_tokens = any(p.wants_tokens for p in policies.values())

    def _breaker_changed(self, url: str, state: str) -> None:
        w = self.registry.get(url)
        role = w.mode if w is not None else ""
        self.metrics.breaker_transitions.labels(url, role, state).inc()
        log = logger.warning if state == "open" else logger.info
        log("worker %s (%s): circuit breaker %s", url, role, state.replace("_", "-"))

    async def aclose(self) -> None:
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    # ------------------------------------------------------------ planning

    def plan(self, text: str, tried: set[str], tokens: Optional[PromptTokens] = None,
             ) -> Optional[tuple[str, Worker, Optional[Worker]]]:
        """("pd", prefill, decode) or ("whole", worker, None); None when nothing can serve."""
        return plan_route(self.registry, self.policies, text, tried, self.cfg.enforce_disaggregation,
                          admit=lambda w: self.breakers.allows(w.url), tokens=tokens)

    def _unavailable(self) -> Response:
        if self.cfg.enforce_disaggregation and not self.registry.has_pd_path():
            return json_error("no healthy prefill/decode pair (disaggregation is enforced)", 503)
        pools = {mode: len(self.registry.pool(mode)) for mode in MODES}
        broken = self.breakers.open_count([w.url for mode in MODES for w in self.registry.pool(mode)])
        if broken:
            return json_error(f"no usable path: {broken} of the healthy workers have an open circuit breaker "
                              f"(GET /workers says which and when they are probed again)", 503)
        if any(pools.values()):  # healthy workers, none of them a path (e.g. every one a prefill server)
            layout = ", ".join(f"{n} {mode}" for mode, n in pools.items())
            return json_error(f"no usable path among the healthy workers ({layout}): a request needs a prefill and a "
                              f"decode worker, or a null or decode one", 503)
        return json_error("no healthy worker available", 503)

    # ------------------------------------------------------------ the retry loop

    def _backoff(self, attempt: int, last: Optional["Failure"]) -> float:
        return self.retry.delay_s(attempt, self._rng, last.leg.retry_after_s() if last is not None else None)

    async def dispatch(self, route: str, body: dict, auth: Optional[str] = None) -> Response:
        stream = bool(body.get("stream"))
        text = request_text(route, body)
        tokens = await self.tokenize(route, body) if self._wants_tokens and self.tokenize is not None else None
        started_at = time.monotonic()
        count = requests_in(route, body)
        ticket = self.observer.arrival(started_at, count) if self.observer is not None else None
        tried: set[str] = set()
        last: Optional[Failure] = None
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt, last))
            plan = self.plan(text, tried, tokens)
            if plan is None:
                break
            kind, first, second = plan
            if kind == "pd":
                out = await self._pd_attempt(route, body, first, second, stream, auth)
            else:
                out = await self._whole_attempt(route, body, first, stream, auth)
            if isinstance(out, Response):
                self.metrics.requests.labels(route, str(out.status_code)).inc()
                self._observe(PD_PATH if kind == "pd" else NULL_PATH, started_at, out, ticket, count)
                return out
            last = out
            tried.update(w.url for w in (first, second) if w is not None)
            if not out.retryable or attempt == self.cfg.max_retries:
                break
            self.metrics.retries.labels(out.leg.worker.url, out.leg.role).inc()
            logger.info("retrying %s after %s", route, out.leg.describe())
        resp = last.response() if last is not None else self._unavailable()
        if self.observer is not None:
            self.observer.forget(ticket)
            self._withdraw_refused(started_at, count, resp.status_code)
        self.metrics.requests.labels(route, str(resp.status_code)).inc()
        return resp

    def _withdraw_refused(self, started_at: float, count: int, status: int) -> None:
        """A request refused as the client's mistake (4xx but a timeout or a rate limit) loaded no worker: the
        planner's window does not count it as an arrival."""
        if 400 <= status < 500 and status not in (408, 429):
            self.observer.withdraw(started_at, count)

    def _observe(self, path: str, started_at: float, out: Response, ticket: Optional[InFlight],
                 count: int = 1) -> None:
        """Tell the planner's window how a successful request went (a stream: as it goes, and once it ends);
        `count`: the generation requests it made (`requests_in`), each observed with its share of the tokens."""
        if self.observer is None:
            return
        if not 200 <= out.status_code < 300:
            self.observer.forget(ticket)
            self._withdraw_refused(started_at, count, out.status_code)
            return
        if isinstance(out, RelayResponse):
            tally = out.tally = StreamTally(time.monotonic(), ticket)

            def ended(completed: bool) -> None:
                if completed:
                    now = time.monotonic()
                    self.observer.completion(now, stream_observation(path, started_at, tally, now, count), ticket,
                                             count)
                else:
                    self.observer.forget(ticket)

            out.on_end = ended
            return
        seen = whole_observation(path, started_at, out.body, count, out.headers.get(SERVER_TIMING))
        self.observer.completion(time.monotonic(), seen, ticket, count)

    # ------------------------------------------------------------ one attempt

    def _headers(self, auth: Optional[str]) -> dict:
        h = {"content-type": "application/json", "accept-encoding": "identity"}
        token = f"Bearer {self.cfg.api_key}" if self.cfg.api_key else auth
        if token:
            h["authorization"] = token
        return h

    def _leg(self, worker: Worker, role: str, route: str, data: bytes, auth: Optional[str]) -> Leg:
        headers = self._headers(auth)
        if worker.reports_epoch:
            headers[EXPECTED_MODE_HEADER] = f"{worker.mode};epoch={worker.epoch}"
        return Leg(worker, role, self.session, self.registry, self.metrics, worker.url + route,
                   data, headers, self.cfg.request_timeout_s, self.breakers)

    async def _whole_attempt(self, route: str, body: dict, w: Worker, stream: bool,
                             auth: Optional[str]) -> Outcome:
        leg = self._leg(w, w.mode, route, msgspec.json.encode(body), auth)
        await leg.run(stream)
        if leg.ok:
            return RelayResponse(leg, None, self._after_stream) if stream else leg.passthrough()
        return Failure(leg, leg.retryable)

    async def _pd_attempt(self, route: str, body: dict, p: Worker, d: Worker, stream: bool,
                          auth: Optional[str]) -> Outcome:
        data = msgspec.json.encode(inject_bootstrap(body, route, p))
        p_leg = self._leg(p, PREFILL, route, data, auth)
        d_leg = self._leg(d, DECODE, route, data, auth)
        d_leg.hold_verdict()
        p_task = _leg_task(p_leg, False)
        d_task = _leg_task(d_leg, stream)
        handed_off = False
        try:
            await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if p_task.done() and not d_task.done() and not p_leg.ok:
                # decode cannot finish without its KV; cut off now, its breaker is not charged
                d_leg.settle(NEUTRAL)
                return Failure(p_leg, p_leg.retryable)
            await d_task
            if not d_leg.ok:
                if not p_task.done():
                    await asyncio.wait({p_task}, timeout=ROOT_CAUSE_WAIT_S)
                if p_task.done() and not p_leg.ok:  # the root cause: decode had no KV to wait for
                    d_leg.settle(NEUTRAL)  # its breaker is not charged with the prefill's failure
                    return Failure(p_leg, p_leg.retryable, d_leg)
                return Failure(d_leg, d_leg.retryable)
            handed_off = True
            d_leg.release_verdict()
            if stream:
                return RelayResponse(d_leg, p_task, self._after_stream)
            return await self._decode_answer(body, d_leg, p_leg, p_task)
        finally:
            if not handed_off:
                await _cancel(p_task, d_task)
                d_leg.settle()  # its own verdict, unless one was given above

    async def _decode_answer(self, body: dict, d_leg: Leg, p_leg: Leg, p_task: asyncio.Task) -> Response:
        if not wants_logprobs(body):
            self._finish_in_background(p_task)
            return d_leg.passthrough()
        await asyncio.wait({p_task}, timeout=self.cfg.prefill_wait_s)
        if not p_task.done():
            await _cancel(p_task)
        if p_leg.ok:
            try:
                out = msgspec.json.decode(d_leg.body)
                if merge_logprobs(out, msgspec.json.decode(p_leg.body)):
                    return Response(msgspec.json.encode(out), status_code=d_leg.status,
                                    media_type="application/json", headers=d_leg.relayed_headers())
            except msgspec.DecodeError:
                logger.warning("could not merge logprobs: a worker's answer is not JSON")
        return d_leg.passthrough()

    def _finish_in_background(self, task: Optional[asyncio.Task]) -> None:
        if task is None or task.done():
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        loop = asyncio.get_running_loop()
        loop.call_later(self.cfg.prefill_wait_s, task.cancel)

    async def _after_stream(self, prefill_task: Optional[asyncio.Task], completed: bool) -> None:
        """A relayed stream ended: let prefill finish (bounded) or, if the client left, cancel it."""
        if prefill_task is None:
            return
        if completed:
            self._finish_in_background(prefill_task)
        else:
            await _cancel(prefill_task)


def _leg_task(leg: Leg, stream: bool) -> asyncio.Task:
    """A leg's call as a task; cancelled before its call began, the leg still settles with its breaker."""
    task = asyncio.ensure_future(leg.run(stream))
    task.add_done_callback(lambda t: leg.settle() if t.cancelled() else None)
    return task


async def _cancel(*tasks: asyncio.Task) -> None:
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
