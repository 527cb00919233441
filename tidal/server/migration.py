"""The API process's side of drain by migration: send a moving request to its new server, relay its answer.

The scheduler offers a running request's KV (tidal/roles/migration.py) in a `MigrationTicket`.
The relay sends the request to the next decode server of the switch's `migrate_to` list, as a
PD request: its prompt is the prompt and every output token but the last (the KV that moves),
its bootstrap fields name the room the KV waits in, and the new server's first token is the last
output token, already sent here (the relay drops it). What the new server streams is buffered
until the scheduler says the KV arrived (`done`), then applied to the request's state as its
own outputs were: the client sees one answer, its text decoded here from all its tokens. An
offer the new server refuses (an HTTP error, a failed stream) is cancelled: the scheduler takes
the request back and its buffered output is dropped (`failed`); after `done` the request fails
with the new server's error.

A stop string the new server cannot see (it started before the tokens it was given as output)
is matched here on the first tokens it sends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

import aiohttp
import msgspec

from tidal.messages import CancelMigrationReq, FinishReason, MigrationTicket, ReqOutput
from tidal.sse import iter_sse

if TYPE_CHECKING:
    from tidal.server.tokenizer_manager import ReqState, TokenizerManager

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0


@dataclass
class Relay:
    """One migrating request: its stream from the new server, and what arrived before `done`."""

    rid: str
    url: str
    sent_before: int  # the request's output tokens when it left (the new server's first token is the last)
    task: Optional[asyncio.Task] = None
    live: bool = False  # the scheduler said `done`: outputs go to the state at once
    buffer: list[ReqOutput] = field(default_factory=list)
    relayed: int = 0  # tokens of the new server's output taken so far (its first included)
    completion_seen: int = 0


def target_body(state: ReqState, ticket: MigrationTicket, rid: str) -> dict:
    """The /generate body that continues `state` on another server from the KV in `ticket`'s room."""
    req, out = state.req, state.output_ids
    sp = msgspec.to_builtins(req.sampling)
    sp["max_new_tokens"] = req.sampling.max_new_tokens - len(out) + 1
    sp["min_new_tokens"] = max(req.sampling.min_new_tokens - len(out) + 1, 0)
    return {
        "rid": rid, "input_ids": list(req.input_ids) + list(out[:-1]), "sampling_params": sp, "stream": True,
        "return_logprob": req.return_logprob, "top_logprobs_num": req.top_logprobs_num, "logprob_start_len": -1,
        "bootstrap_host": ticket.bootstrap_host, "bootstrap_port": ticket.bootstrap_port,
        "bootstrap_room": ticket.bootstrap_room,
    }


class MigrationRelay:
    def __init__(self, tm: TokenizerManager, api_key: Optional[str], retract_targets: Sequence[str] = ()) -> None:
        self.tm = tm
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.targets: list[str] = []  # the last drain_policy migrate switch's migrate_to
        self.retract_targets = [u.rstrip("/") for u in retract_targets]  # --retraction-migrate-to
        self._turn = itertools.count()
        self._ids = itertools.count(1)
        self.relays: dict[str, Relay] = {}
        self._session: Optional[aiohttp.ClientSession] = None

    def set_targets(self, urls: list[str]) -> None:
        self.targets = [u.rstrip("/") for u in urls]

    # ------------------------------------------------------------ tickets from the scheduler

    def on_ticket(self, state: ReqState, ticket: MigrationTicket) -> None:
        if ticket.state == "offer":
            self._offer(state, ticket)
        elif ticket.state == "done":
            self._go_live(state)
        elif ticket.state == "failed":
            self._drop(state.rid)

    def _offer(self, state: ReqState, ticket: MigrationTicket) -> None:
        want = len(state.req.input_ids) + len(state.output_ids) - 1
        targets = self.retract_targets if ticket.cause == "retract" else self.targets
        if not targets or not state.output_ids or ticket.kv_tokens != want:
            why = "no server to migrate to" if not targets else \
                f"the request holds {want} tokens here, the offer {ticket.kv_tokens}"
            self.tm.send_control(CancelMigrationReq(rid=state.rid, reason=why))
            return
        url = targets[next(self._turn) % len(targets)]
        relay = Relay(state.rid, url, sent_before=len(state.output_ids))
        body = target_body(state, ticket, f"{state.rid}-migrated-{next(self._ids)}")
        relay.task = asyncio.get_running_loop().create_task(self._stream(relay, state, body))
        self.relays[state.rid] = relay
        logger.info("request %s continues on %s (%d tokens of KV)", state.rid, url, ticket.kv_tokens)

    def _go_live(self, state: ReqState) -> None:
        relay = self.relays.get(state.rid)
        if relay is None:
            return
        relay.live = True
        for out in relay.buffer:
            self.tm.apply_relayed(out)
        relay.buffer.clear()
        if state.finished:
            self._drop(state.rid)

    def _drop(self, rid: str) -> None:
        relay = self.relays.pop(rid, None)
        if relay is not None and relay.task not in (None, asyncio.current_task()) and not relay.task.done():
            relay.task.cancel()  # closing the stream aborts the request on the new server

    def cancel(self, rid: str) -> None:
        """The request is over here (the client left, or it was aborted)."""
        self._drop(rid)

    # ------------------------------------------------------------ the new server's stream

    async def _stream(self, relay: Relay, state: ReqState, body: dict) -> None:
        error: Optional[str] = None
        try:
            session = await self._client()
            async with session.post(relay.url + "/generate", json=body, headers=self.headers,
                                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)) as r:
                if r.status != 200:
                    error = f"{relay.url} answered {r.status}: {(await r.text())[:300]}"
                else:
                    error = await self._read_events(relay, state, r)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a connection error, a bad event
            error = f"{relay.url}: {type(e).__name__}: {e}"
        if error is None or self.relays.get(relay.rid) is not relay:
            return
        if relay.live:
            self.relays.pop(relay.rid, None)
            self.tm.apply_relayed(ReqOutput(rid=relay.rid, new_token_ids=[], finish_reason=FinishReason(
                type="abort", message=f"the server this request migrated to failed: {error}", status_code=502)))
        else:
            logger.warning("request %s cannot migrate to %s: %s", relay.rid, relay.url, error)
            self.tm.send_control(CancelMigrationReq(rid=relay.rid, reason=error))

    async def _read_events(self, relay: Relay, state: ReqState, r: aiohttp.ClientResponse) -> Optional[str]:
        """Relay every event until the answer ends; an error's text, or None."""
        async for event in iter_sse(r):
            if event is None:  # data: [DONE]
                return None
            if "error" in event:
                err = event["error"]
                return err.get("message", str(err)) if isinstance(err, dict) else str(err)
            out = self._output_of(relay, state, event)
            if out is None:
                continue
            if relay.live:
                self.tm.apply_relayed(out)
            else:
                relay.buffer.append(out)
            if out.finish_reason is not None:
                return None
        return f"{relay.url} ended the stream before the answer did"

    def _output_of(self, relay: Relay, state: ReqState, event: dict) -> Optional[ReqOutput]:
        """The new tokens of a cumulative /generate event as a ReqOutput of the request here."""
        ids = event.get("output_ids") or []
        meta = event.get("meta_info") or {}
        fresh = ids[relay.relayed:]
        start = relay.relayed
        relay.relayed = len(ids)
        if start == 0:  # the first is the last token sent before the move
            fresh, start = fresh[1:], 1
        finish = meta.get("finish_reason")
        finish_reason = msgspec.convert(finish, FinishReason) if finish else None
        if not fresh and finish_reason is None:
            return None
        out = ReqOutput(rid=relay.rid, new_token_ids=list(fresh), finish_reason=finish_reason,
                        completion_tokens=relay.sent_before - 1 + len(ids))
        if state.req.return_logprob:
            out.output_logprobs = [(lp, tid) for lp, tid, *_ in meta.get("output_token_logprobs", [])[start:]]
            if state.req.top_logprobs_num > 0:
                out.output_top_logprobs = [[(lp, tid) for lp, tid, *_ in row]
                                           for row in meta.get("output_top_logprobs", [])[start:]]
        self._stop_at_boundary(relay, state, out)
        return out

    def _stop_at_boundary(self, relay: Relay, state: ReqState, out: ReqOutput) -> None:
        """End `out` at a stop string that began before the move (the new server saw only its own output)."""
        stop = state.req.sampling.stop
        if not stop or relay.completion_seen > max(len(s) for s in stop):
            relay.completion_seen += len(out.new_token_ids)
            return
        longest = max(len(s) for s in stop)
        before = list(state.output_ids) + [t for o in relay.buffer for t in o.new_token_ids]
        skip = state.req.sampling.skip_special_tokens
        for i in range(len(out.new_token_ids)):
            ids = (before + out.new_token_ids[: i + 1])[-(longest + 1):]
            tail = self.tm.tokenizer.decode(ids, skip_special_tokens=skip)
            matched = next((s for s in stop if s in tail), None)
            if matched is not None:
                out.new_token_ids = out.new_token_ids[: i + 1]
                out.finish_reason = FinishReason(type="stop", matched=matched)
                if out.output_logprobs is not None:
                    out.output_logprobs = out.output_logprobs[: i + 1]
                if out.output_top_logprobs is not None:
                    out.output_top_logprobs = out.output_top_logprobs[: i + 1]
                break
        relay.completion_seen += len(out.new_token_ids)

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        for rid in list(self.relays):
            self._drop(rid)
        if self._session is not None:
            await self._session.close()
            self._session = None
