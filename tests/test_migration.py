"""Migration on the KV-reading fake model (its next token depends on the whole KV it reads, so KV that
moved wrong shows in the tokens): a switch's running requests move to a decode server and on again from
there, a retraction moves its victims instead of re-prefilling them, a refused or cancelled move resumes
here, an abort while moving frees everything, requests whose state does not travel stay; the tokens equal
the reference and both pools stay intact. The API process's relay is played by `Relay` below."""

from __future__ import annotations

import random
import time

import pytest

from fakes import FakeModelRunner, reference_generate
from tidal.config import ServerArgs
from tidal.messages import AbortReq, CancelMigrationReq, GenerateReq, SwitchModeReq
from tidal.roles.migration import why_not_migratable
from tidal.sampling_params import SamplingParams
from tidal.scheduler.req import Req
from tidal.scheduler.scheduler import Scheduler
from servers import free_port

pytestmark = pytest.mark.timeout(180)


def make(mode: str = "null", total: int = 4096, page_size: int = 1, **kw) -> Scheduler:
    args = ServerArgs(model_path="fake", disaggregation_mode=mode, disaggregation_transfer_backend="tcp",
                      disaggregation_bootstrap_port=free_port(), chunked_prefill_size=16, num_reserved_decode_tokens=8,
                      enable_dynamic_disaggregation=True, page_size=page_size, **kw)
    return Scheduler(args, FakeModelRunner(max_total_tokens=total, page_size=page_size), tokenizer=None)


class Relay:
    """What the API process does with tickets (tidal/server/migration.py), between schedulers in this process:
    an offer becomes a PD request on `to[source]`, whose output after its first token is the request's."""

    def __init__(self, scheds: list[Scheduler], to: dict[int, Scheduler], refuse: bool = False):
        self.scheds, self.to, self.refuse = scheds, to, refuse
        self.tokens: dict[str, list[int]] = {}  # by the client's rid
        self.finish: dict[str, object] = {}
        self.alias: dict[str, tuple[str, bool]] = {}  # a server's rid -> (client rid, first token seen)
        self.prompts: dict[str, list[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.hops = 0

    def submit(self, s: Scheduler, rid: str, prompt: list[int], sampling: SamplingParams) -> None:
        self.prompts[rid], self.params[rid], self.tokens[rid] = prompt, sampling, []
        self.alias[rid] = (rid, True)
        s.handle(GenerateReq(rid=rid, input_ids=prompt, sampling=sampling, stream=True))

    def run(self, until, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            busy = False
            for s in self.scheds:
                busy |= s.step()
                s.check_integrity()
                for o in s.take_outbox():
                    self._on(s, o)
            if until():
                return
            if not busy:
                time.sleep(0.002)
        raise AssertionError(f"not done: {[s.controller.queue_sizes() for s in self.scheds]}")

    def _on(self, s: Scheduler, o) -> None:
        rid, seen = self.alias[o.rid]
        new = o.new_token_ids if seen else o.new_token_ids[1:]  # a hop's first token was sent before it
        self.alias[o.rid] = (rid, True)
        self.tokens[rid] += new
        if o.finish_reason is not None:
            self.finish[rid] = o.finish_reason
        t = o.migration
        if t is not None and t.state == "offer":
            if self.refuse:
                s.handle(CancelMigrationReq(rid=o.rid, reason="refused by the test"))
                return
            self.hops += 1
            out = self.tokens[rid]
            sp = self.params[rid]
            hop = f"{rid}-hop{self.hops}"
            self.alias[hop] = (rid, False)
            assert t.kv_tokens == len(self.prompts[rid]) + len(out) - 1
            self.to[id(s)].handle(GenerateReq(
                rid=hop, input_ids=self.prompts[rid] + out[:-1],
                sampling=SamplingParams(max_new_tokens=sp.max_new_tokens - len(out) + 1, temperature=0), stream=True,
                bootstrap_host=t.bootstrap_host, bootstrap_port=t.bootstrap_port, bootstrap_room=t.bootstrap_room))

    def done(self, rids) -> bool:
        return all(r in self.finish for r in rids) and all(s.is_idle() for s in self.scheds)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randint(4, 20))] for _ in range(n)]


def switch(s: Scheduler, mode: str, **kw):
    s.handle(SwitchModeReq(call_id=1, mode=mode, drain=True, **kw))
    replies = s.take_replies()
    return replies[0] if replies else None


@pytest.fixture
def scheds():
    made: list[Scheduler] = []

    def factory(*a, **kw) -> Scheduler:
        made.append(make(*a, **kw))
        return made[-1]

    yield factory
    for s in made:
        s.shutdown()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_switch_moves_running_requests_and_a_decode_server_moves_them_on(scheds, page_size):
    a, b, c = scheds("null", page_size=page_size), scheds("decode", page_size=page_size), \
        scheds("decode", page_size=page_size)
    relay = Relay([a, b, c], {id(a): b, id(b): c})
    ps, n = prompts(3), 60
    for i, p in enumerate(ps):
        relay.submit(a, f"r{i}", p, SamplingParams(max_new_tokens=n, temperature=0))
    relay.run(lambda: all(len(relay.tokens[f"r{i}"]) >= 5 for i in range(3)))
    assert switch(a, "prefill", timeout_s=0.0, migrate=True) is None  # answered once they left
    replies = []
    relay.run(lambda: bool(replies.extend(a.take_replies()) or replies))
    assert replies[0].status_code == 200 and replies[0].migrated == 3, replies[0]
    assert a.role.name == "prefill" and a.migrator.migrated == 3
    relay.run(lambda: all(len(relay.tokens[f"r{i}"]) >= 20 for i in range(3)))
    assert switch(b, "null", timeout_s=0.0, migrate=True) is None  # decode -> null, its requests on to c
    replies = []
    relay.run(lambda: bool(replies.extend(b.take_replies()) or replies))
    assert replies[0].status_code == 200 and replies[0].migrated == 3, replies[0]
    relay.run(lambda: relay.done([f"r{i}" for i in range(3)]))
    for i, p in enumerate(ps):
        assert relay.tokens[f"r{i}"] == reference_generate(p, n), i
        assert relay.finish[f"r{i}"].type == "length"
    assert relay.hops == 6


def test_a_retraction_moves_its_victims_instead_of_prefilling_them_again(scheds):
    a = scheds("null", total=160, retraction_migrate_to=("http://127.0.0.1:1",))
    b = scheds("decode")
    relay = Relay([a, b], {id(a): b})
    ps, n = prompts(4, seed=3), 50
    for i, p in enumerate(ps):
        relay.submit(a, f"r{i}", p, SamplingParams(max_new_tokens=n, temperature=0))
    relay.run(lambda: relay.done([f"r{i}" for i in range(4)]))
    assert a.migrator.migrated > 0 and a.stats.num_retracted == 0
    assert a.make_stats(0).num_migrated_total == a.migrator.migrated
    for i, p in enumerate(ps):
        assert relay.tokens[f"r{i}"] == reference_generate(p, n), i


def test_a_refused_move_resumes_here_and_the_switch_times_out(scheds):
    a, b = scheds("null"), scheds("decode")
    relay = Relay([a, b], {id(a): b}, refuse=True)
    ps, n = prompts(2, seed=5), 400
    for i, p in enumerate(ps):
        relay.submit(a, f"r{i}", p, SamplingParams(max_new_tokens=n, temperature=0))
    relay.run(lambda: all(relay.tokens[f"r{i}"] for i in range(2)))
    assert switch(a, "prefill", timeout_s=0.0, migrate=True, migrate_timeout_s=0.3) is None
    replies = []
    relay.run(lambda: bool(replies.extend(a.take_replies()) or replies))
    r = replies[0]
    assert r.status_code == 504 and r.current_mode == "null" and "its migration failed" in r.message, r
    assert a.migrator.failed == 2 and a.migrator.migrated == 0
    relay.run(lambda: relay.done(["r0", "r1"]))
    for i, p in enumerate(ps):
        assert relay.tokens[f"r{i}"] == reference_generate(p, n), i


def test_an_abort_while_moving_frees_everything(scheds):
    a, b = scheds("null"), scheds("decode")
    relay = Relay([a, b], {})  # offers go nowhere: the request waits for a server that never comes
    relay.to = {id(a): None}
    relay._on = lambda s, o, on=relay._on: None if o.migration is not None and o.migration.state == "offer" \
        else on(s, o)
    relay.submit(a, "r0", prompts(1)[0], SamplingParams(max_new_tokens=300, temperature=0))
    relay.run(lambda: len(relay.tokens["r0"]) >= 3)
    assert switch(a, "prefill", timeout_s=0.0, migrate=True) is None
    relay.run(lambda: len(a.migrator.moving) == 1)
    a.handle(AbortReq(rid="r0"))
    relay.run(lambda: "r0" in relay.finish and a.is_idle())
    assert relay.finish["r0"].type == "abort" and relay.finish["r0"].status_code == 499
    assert a.migrator.moving == [] and a.mem.req_to_token_pool.available_size() > 0
    replies = []
    relay.run(lambda: bool(replies.extend(a.take_replies()) or replies))
    assert replies[0].status_code == 200 and a.role.name == "prefill"


@pytest.mark.parametrize("sampling, why", [
    (SamplingParams(frequency_penalty=0.5), "penalties"),
    (SamplingParams(temperature=0.7, seed=3), "seeded sampling"),
    (SamplingParams(regex="[ab]+"), "constrained decoding"),
])
def test_requests_whose_state_does_not_travel_stay(sampling, why):
    req = Req(GenerateReq(rid="x", input_ids=[1, 2], sampling=sampling))
    assert why in (why_not_migratable(req) or "")
    assert why_not_migratable(Req(GenerateReq(rid="y", input_ids=[1], sampling=SamplingParams(seed=3,
                                                                                                temperature=0)))) is None
