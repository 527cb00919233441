"""Constrained decoding below HTTP: grammar validation, the sampler's masks, and the scheduler's
grammar queue, batched masks, chunked prefill, overlap and retraction (a fake model with the
real tokenizer, so every output can be decoded and checked against its grammar)."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch

from fakes import FakeModelRunner
from test_overlap import run
from tidal.config import ServerArgs, default_model_path
from tidal.constrained.grammar import GrammarError, to_llguidance
from tidal.messages import AbortReq, GenerateReq
from tidal.model.sampler import Sampler, SamplingBatchInfo
from tidal.model.tokenizer import load_tokenizer
from tidal.sampling_params import SamplingParams
from tidal.scheduler.scheduler import Scheduler
from tidal.server.protocol import ApiError, openai_sampling_dict, response_format_grammar, ChatCompletionRequest

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
EBNF = 'root ::= answer "." \nanswer ::= "yes" | "no" | "maybe"'


# ---------------------------------------------------------------- grammars


@pytest.mark.parametrize("kind,text,needle", [
    ("json_schema", '{"type": "objekt"}', "objekt"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "JSON object"),
    ("regex", "a(b", "unclosed group"),
    ("ebnf", "root ::= missing", "missing"),
    ("structural_tag", '{"structures": []}', "structures"),
    ("structural_tag", '{"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<g"]}', "triggers"),
])
def test_invalid_grammars_are_refused_with_the_reason(kind, text, needle):
    with pytest.raises(GrammarError, match=re.escape(needle)):
        to_llguidance(kind, text)


def test_valid_grammars_compile():
    for kind, text in [("json_schema", json.dumps(SCHEMA)), ("regex", PHONE), ("ebnf", EBNF),
                       ("structural_tag", '{"structures": [{"begin": "<f=a>", "schema": {"type": "object"}, '
                                          '"end": "</f>"}], "triggers": ["<f="]}')]:
        assert to_llguidance(kind, text)


def test_one_grammar_per_request():
    with pytest.raises(ValueError, match="only one of"):
        SamplingParams(regex="a", json_schema="{}").validate()


def test_response_format_maps_to_sglang_fields():
    assert response_format_grammar({"type": "text"}) == {}
    assert response_format_grammar({"type": "json_object"}) == {"json_schema": '{"type": "object"}'}
    got = response_format_grammar({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    assert json.loads(got["json_schema"]) == SCHEMA
    with pytest.raises(ApiError, match="not supported"):
        response_format_grammar({"type": "xml"})
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], regex="a",
                                 response_format={"type": "json_object"})
    with pytest.raises(ApiError, match="cannot be combined"):
        openai_sampling_dict(body, 8)


# ---------------------------------------------------------------- sampler masks


def _info(params: list[SamplingParams], vocab: int) -> SamplingBatchInfo:
    return SamplingBatchInfo.build(params, [[] for _ in params], [[1] for _ in params], vocab, "cpu")


def test_masks_bind_greedy_and_sampled_rows_and_leave_others_alone():
    torch.manual_seed(0)
    vocab = 64
    logits = torch.randn(3, vocab)
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[0, [5, 9]] = True
    allowed[1, [7, 11, 13]] = True
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5), SamplingParams(temperature=0)]
    for _ in range(50):
        info = _info(params, vocab)
        info.allowed_tokens = (torch.tensor([0, 1]), allowed)
        ids = Sampler().sample(logits, info).next_token_ids.tolist()
        assert ids[0] == max((5, 9), key=lambda t: logits[0, t])
        assert ids[1] in (7, 11, 13)
        assert ids[2] == int(logits[2].argmax())


def test_a_row_with_no_usable_candidate_falls_back_inside_its_grammar():
    vocab = 16
    logits = torch.zeros(1, vocab)
    logits[0, 3] = 5.0  # the raw argmax, which the grammar forbids
    info = _info([SamplingParams(temperature=0, min_new_tokens=4)], vocab)
    info.min_tokens_mask = (torch.tensor([0]), torch.tensor([8]))  # bans the only allowed token
    allowed = torch.zeros(1, vocab, dtype=torch.bool)
    allowed[0, 8] = True
    info.allowed_tokens = (torch.tensor([0]), allowed)
    assert Sampler().sample(logits, info).next_token_ids.tolist() == [8]


# ---------------------------------------------------------------- the scheduler


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


class WideFakeRunner(FakeModelRunner):
    """The fake model over the real tokenizer's vocabulary: its prediction gets +10, every other
    token a fixed pseudo-random score (so a grammar's choice among allowed tokens is stable)."""

    VOCAB = 49152

    def __init__(self, *a, flat: bool = False, **kw):
        super().__init__(*a, **kw)
        self.model_config.vocab_size = self.VOCAB
        self.model_config.eos_token_ids = [2]
        self.noise = torch.rand(self.VOCAB, generator=torch.Generator().manual_seed(1)) * (1.0 if flat else 5.0)

    def forward(self, fb, logit_rows):
        narrow = super().forward(fb, logit_rows)
        wide = self.noise.expand(narrow.shape[0], self.VOCAB).clone()
        wide[:, 1:narrow.shape[1]] += narrow[:, 1:]  # the fake's EOS (0) is not this vocabulary's
        return wide


def make(tokenizer, overlap: bool = True, runner=None, **kw) -> Scheduler:
    args = ServerArgs(model_path="fake", disable_overlap_schedule=not overlap, **kw)
    runner = runner or WideFakeRunner(max_total_tokens=4096, page_size=args.page_size)
    return Scheduler(args, runner, tokenizer=tokenizer)


def constrained_reqs(n_plain: int = 3, temperature: float = 0.0, prompt_len: int = 12) -> list[GenerateReq]:
    kinds = [("json_schema", json.dumps(SCHEMA)), ("regex", PHONE), ("ebnf", EBNF)]
    reqs = []
    for i, (kind, text) in enumerate(kinds):
        sp = SamplingParams(max_new_tokens=60, temperature=temperature, seed=i, **{kind: text})
        reqs.append(GenerateReq(rid=f"{kind}", input_ids=[10 + i + j for j in range(prompt_len)], sampling=sp))
    for i in range(n_plain):
        sp = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
        reqs.append(GenerateReq(rid=f"plain{i}", input_ids=[40 + i + j for j in range(prompt_len)], sampling=sp))
    return reqs


def check_outputs(tokenizer, got: dict) -> None:
    for rid, (ids, finish) in got.items():
        text = tokenizer.decode([t for t in ids if t != 2])
        if rid == "json_schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif rid == "regex":
            assert re.fullmatch(PHONE, text), text
        elif rid == "ebnf":
            assert text in ("yes.", "no.", "maybe."), text
        if not rid.startswith("plain"):
            assert finish == "stop", (rid, finish, text)


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_batch_outputs_obey_their_grammars(tokenizer, overlap):
    sched = make(tokenizer, overlap)
    got = run(sched, constrained_reqs())
    check_outputs(tokenizer, got)
    plain = run(make(tokenizer, overlap), constrained_reqs()[3:])
    assert {k: v for k, v in got.items() if k.startswith("plain")} == plain  # neighbours change nothing
    assert sched.grammars.num_compiled == 3


def test_overlap_and_serial_loops_agree_and_the_cache_is_used(tokenizer):
    on, off = make(tokenizer, True), make(tokenizer, False)
    first = run(on, constrained_reqs(temperature=0.9))
    assert first == run(off, constrained_reqs(temperature=0.9))  # seeded sampling under grammars
    check_outputs(tokenizer, first)
    again = [GenerateReq(rid=r.rid, input_ids=r.input_ids, sampling=r.sampling) for r in constrained_reqs(0, 0.9)]
    assert run(on, again) == {k: v for k, v in first.items() if not k.startswith("plain")}
    assert on.grammars.num_cache_hits == 3 and on.grammars.num_compiled == 3


@pytest.mark.parametrize("page_size,chunk", [(1, 8), (4, 16)])
def test_chunked_prefill_samples_only_the_last_chunk_under_the_grammar(tokenizer, page_size, chunk):
    sched = make(tokenizer, page_size=page_size, chunked_prefill_size=chunk)
    got = run(sched, constrained_reqs(prompt_len=45))  # three chunks or more per prompt
    check_outputs(tokenizer, got)


def test_retracted_requests_resume_their_grammar(tokenizer):
    runner = WideFakeRunner(max_total_tokens=320, page_size=1)
    sched = make(tokenizer, runner=runner, chunked_prefill_size=64)
    reqs = constrained_reqs(n_plain=8, prompt_len=15)
    for r in reqs:
        r.sampling.max_new_tokens = 40 if r.rid.startswith("plain") else 60
    got = run(sched, reqs)
    assert sched.stats.num_retracted > 0
    check_outputs(tokenizer, got)


def test_scheduler_refuses_a_bad_grammar_and_aborts_queued_ones(tokenizer):
    sched = make(tokenizer)
    bad = GenerateReq(rid="bad", input_ids=[5, 6, 7], sampling=SamplingParams(regex="a(b"))
    queued = GenerateReq(rid="queued", input_ids=[5, 6, 7], sampling=SamplingParams(regex="[a-z]{900}"))
    sched.handle(bad)
    sched.handle(queued)
    sched.handle(AbortReq(rid="queued"))
    outs = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (len(outs) == 2 and sched.is_idle()):
        if not sched.step():
            time.sleep(0.01)  # the grammar compiles on its own thread
        for o in sched.take_outbox():
            outs[o.rid] = o.finish_reason
    assert outs["bad"].status_code == 400 and "unclosed group" in outs["bad"].message
    assert outs["queued"].type == "abort"
    assert not sched.grammars.waiting
    sched.check_integrity()


def test_tensor_parallel_ranks_agree_on_the_grammar_queue_and_tokens(tokenizer):
    """Each rank compiles on its own thread; the ranks must still admit every request at the same
    iteration and draw the same constrained tokens (test_tp_scheduler.run asserts it per step)."""
    from test_tp_scheduler import run as run_tp
    from tp_ranks import RankGroup

    args = ServerArgs(model_path="fake", tp_size=2, chunked_prefill_size=16)

    def make_rank(comm):
        runner = WideFakeRunner(max_total_tokens=4096)
        runner.tp = comm
        return Scheduler(args, runner, tokenizer=tokenizer)

    group = RankGroup(2, make_rank)
    try:
        for r in constrained_reqs(temperature=0.9, prompt_len=30):
            group.handle(r)
        (out,) = run_tp([group], timeout=120)
        check_outputs(tokenizer, {rid: (toks, fin.type) for rid, (toks, fin) in out.items()})
    finally:
        group.close()
