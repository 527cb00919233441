"""Migrator: running requests move to another decode server with their KV, and resume there.

A request that migrates stops decoding here and offers its KV (the prompt and every output
token but the last, whose KV the next pass would compute) as a prefill server offers a prompt's:
a sender for a fresh room behind this server's migration bootstrap server (rank 0 runs it, every
rank registers; started on first use). The offer reaches the API process in the request's next
output (`MigrationTicket`, after every token not yet sent); the API process sends the request
there as a PD request whose prompt is those tokens and whose first token is the last output token
(tidal/server/migration.py), and relays the answer. The new server pulls the KV as from a prefill
server (any TP sizes: tidal/transfer/heads.py); once it confirmed every page the request is gone
from here (`done`). A migration that fails, or that the API process cancels (the new server
refused), goes back to the running batch with the KV it never gave up (`failed`), and is not
offered again.

Requests whose state does not travel in their prompt stay: constrained ones (the grammar's
state), those with penalties (they count output tokens, which the new server takes for prompt),
seeded sampling (the new server's generator would start over), LoRA, embeddings. Greedy ones
continue exactly as they would have here.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import TYPE_CHECKING, Any, Optional

from tidal.messages import MigrationTicket
from tidal.roles.pd_common import PDState, TransferComponents, fail_request, failure_reason, page_indices
from tidal.scheduler.req import Req

if TYPE_CHECKING:
    from tidal.roles.loop import ControllerLoop

logger = logging.getLogger(__name__)


def why_not_migratable(req: Req) -> Optional[str]:
    """Why the request cannot continue on another server from its tokens alone (None: it can)."""
    sp = req.sampling
    if req.is_embedding:
        return "an embedding"
    if req.grammar is not None or sp.grammar_key is not None:
        return "constrained decoding (the grammar's state stays here)"
    if sp.has_penalties:
        return "penalties (they count the output, which the new server would take for prompt)"
    if sp.seed is not None and not sp.is_greedy:
        return "seeded sampling (the new server's generator would start over)"
    if req.lora_name is not None:
        return "a LoRA adapter"
    return None


def migration_room(rid: str, attempt: int) -> int:
    """The same room on every TP rank, distinct per request and attempt."""
    digest = hashlib.sha256(f"tidal-migration:{rid}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class Migrator:
    def __init__(self, sched: ControllerLoop) -> None:
        self.s = sched
        self.transfer: Optional[TransferComponents] = None
        self.bootstrap_server: Any = None
        self.port = 0
        self.moving: list[Req] = []  # offered, their KV still here
        self.refused: set[str] = set()  # rids whose migration failed: they finish here
        self.attempts = 0
        self.migrated = 0
        self.failed = 0

    # ------------------------------------------------------------------ starting

    def can_take(self, req: Req) -> bool:
        return not req.finished and req.rid not in self.refused and why_not_migratable(req) is None

    def offer_running(self) -> int:
        """Offer every running request that can migrate (the loop holds no pass in flight); how many."""
        s = self.s
        reqs = [r for r in s.running if self.can_take(r)]
        for req in reqs:
            self.offer(req, "switch")
        s.running = [r for r in s.running if r not in reqs]
        return len(reqs)

    @property
    def retracts_by_migration(self) -> bool:
        """--retraction-migrate-to: a retracted request moves to another server when it can."""
        return bool(self.s.args.retraction_migrate_to)

    def _ensure_transfer(self) -> None:
        """Rank 0 starts the migration bootstrap server (the port from --migration-bootstrap-port, 0: any free
        one) and every rank registers its sender with it."""
        if self.transfer is not None:
            return
        from tidal.transfer import BootstrapServer

        s, args = self.s, self.s.args
        if s.tp.rank == 0:
            self.bootstrap_server = BootstrapServer(args.host, args.migration_bootstrap_port,
                                                    args.disaggregation_bootstrap_key)
            self.bootstrap_server.start()
            self.port = self.bootstrap_server.port
        self.port = int(s.tp.all_gather_ints([self.port])[0, 0]) if s.tp.size > 1 else self.port
        self.transfer = TransferComponents(s, "prefill", None)
        self.transfer.register(self.port)
        logger.info("migration bootstrap server on port %d", self.port)

    def offer(self, req: Req, cause: str) -> None:
        """Offer the request's KV to another server; the caller takes it out of the running batch."""
        from tidal.transfer import create_kv_sender

        self._ensure_transfer()
        self.attempts += 1
        room = migration_room(req.rid, self.attempts)
        host = advertised_host(self.s.args.host)
        req.pd = PDState(peer=create_kv_sender(self.transfer.manager, f"{host}:{self.port}", room), room=room)
        out = req.take_output(final=False)  # every token not sent yet, then the offer
        out.migration = MigrationTicket(state="offer", cause=cause, bootstrap_host=host, bootstrap_port=self.port,
                                        bootstrap_room=room, kv_tokens=req.kv_len)
        self.s.outbox.append(out)
        self.moving.append(req)
        logger.info("request %s migrates: %d KV tokens offered in room %d", req.rid, req.kv_len, room)

    # ------------------------------------------------------------------ the loop

    def poll(self) -> None:
        """Send the KV of offers whose new server is ready; end those it confirmed; resume those that failed."""
        if not self.moving:
            return
        from tidal.transfer import KVPoll, poll_and_all_reduce

        keep = []
        for req in self.moving:
            if req.to_abort and req.pd.extra.get("aborting") is None:
                req.pd.extra["aborting"] = True
                req.pd.peer.abort()
        polls = poll_and_all_reduce([r.pd.peer for r in self.moving], self.s.tp)
        for req, poll in zip(self.moving, polls):
            if poll == KVPoll.Success:
                self._done(req)
            elif poll == KVPoll.Failed:
                self._resume(req, failure_reason(req.pd.peer, "KV migration failed"))
            else:
                if poll >= KVPoll.WaitingForInput:
                    self._send(req)  # False: no metadata slot free; the next iteration tries again
                keep.append(req)
        self.moving = keep

    def _send(self, req: Req) -> bool:
        from tidal.transfer import MetadataRecord

        if req.pd.extra.get("sent"):
            return True
        idx = self.transfer.metadata.alloc()
        if idx is None:
            return False
        req.pd.metadata_idx = idx
        ps = self.s.mem.page_size
        req.pd.peer.init(-(-req.kv_len // ps), idx)
        rec = MetadataRecord(output_id=req.output_ids[-1], cached_tokens=req.cached_tokens, bootstrap_room=req.pd.room)
        if req.output_logprobs:
            rec.logprob = req.output_logprobs[-1][0]
        self.transfer.metadata.set(idx, rec)
        req.pd.peer.send(page_indices(self.s, req, 0, req.kv_len, include_partial=True), is_last=True)
        req.pd.extra["sent"] = True
        return True

    def _done(self, req: Req) -> None:
        self._free_metadata(req)
        req.pd = None
        self.s.mem.release(req)  # its KV goes to the prefix cache (a radix cache keeps the prefix)
        out = req.take_output(final=False)
        out.migration = MigrationTicket(state="done")
        self.s.outbox.append(out)
        self.s.lora.on_finished(req.rid)
        self.migrated += 1
        logger.info("request %s migrated", req.rid)

    def _resume(self, req: Req, reason: str) -> None:
        self._free_metadata(req)
        req.pd = None
        self.failed += 1
        if req.to_abort:
            fail_request(self.s, req, req.to_abort, status_code=499)
            return
        self.refused.add(req.rid)
        logger.warning("request %s did not migrate (%s): it goes on here", req.rid, reason)
        out = req.take_output(final=False)
        out.migration = MigrationTicket(state="failed", message=reason)
        self.s.outbox.append(out)
        self.s.running.append(req)

    def _free_metadata(self, req: Req) -> None:
        if req.pd is not None and req.pd.metadata_idx is not None:
            self.transfer.metadata.free(req.pd.metadata_idx)
            req.pd.metadata_idx = None

    # ------------------------------------------------------------------ control

    def cancel(self, rid: str, reason: str) -> None:
        """The API process could not place the request: fail its offer (it resumes here once its peer failed)."""
        for req in self.moving:
            if req.rid == rid:
                logger.info("migration of %s cancelled: %s", rid, reason)
                req.pd.peer.abort()

    def forget_refusals(self) -> None:
        """A new switch: every request may try again."""
        self.refused.clear()

    def is_idle(self) -> bool:
        return not self.moving

    def moving_tokens(self) -> int:
        """The KV tokens that go back to this server's pool once the moving requests arrived."""
        return sum(r.kv_len for r in self.moving)

    def queue_sizes(self) -> dict:
        return {"migrating": len(self.moving)} if self.moving else {}

    def shutdown(self) -> None:
        for req in self.moving:
            req.pd.peer.abort()
        if self.transfer is not None:
            self.transfer.forget_registration()
            self.transfer.shutdown()
            self.transfer = None
        if self.bootstrap_server is not None:
            self.bootstrap_server.stop()
            self.bootstrap_server = None


def advertised_host(host: str) -> str:
    """The address other servers reach this one at (as the transfer's own endpoints)."""
    if host not in ("0.0.0.0", "", "::"):
        return host
    return os.environ.get("TIDAL_DISAGG_ADVERTISE_HOST", "127.0.0.1")

