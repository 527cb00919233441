"""The planner's data: what it reads, what it predicts, what it decides."""

from __future__ import annotations

import math
from typing import Optional

import msgspec

PREFILL, DECODE, NULL = "prefill", "decode", "null"
MODES = (NULL, PREFILL, DECODE)
PD_PATH, NULL_PATH = "pd", "null"  # how a request is served: prefill+decode pair, or one worker
PLANNER_MODES = ("static", "sla", "advise")
DECODE_MOVES = ("handover", "drain", "migrate")  # how a decode (or null) worker leaves its pool (PlannerConfig.decode_move)
MIN_INTERVAL_S = 0.1  # the shortest --planner-interval-s


class WorkerLoad(msgspec.Struct, kw_only=True):
    """One worker as the router last saw it (its `/get_load`, summed over DP ranks)."""
    url: str
    mode: str
    running_reqs: int = 0
    waiting_reqs: int = 0
    queued_prefill_tokens: int = 0
    kv_tokens_used: int = 0
    kv_tokens_total: int = 0
    in_flight: int = 0  # requests this router has open on it
    decoding_reqs: int = -1  # requests in its running batch (-1: not reported; running_reqs stands in)
    waiting_prompt_tokens: int = -1  # the whole prompts of its waiting_reqs (-1: not reported)
    # since the worker started: requests it accepted and their prompts' tokens, counted on arrival (-1: not reported)
    prompts_received: int = -1
    prompt_tokens_received: int = -1
    # during a handover: the role whose requests it still finishes; until they end a move to a third role would
    # wait for them out of every pool, so only the move back to that role is legal
    handing_over_from: str = ""

    @property
    def kv_usage(self) -> float:
        return self.kv_tokens_used / self.kv_tokens_total if self.kv_tokens_total else 0.0


class Traffic(msgspec.Struct, kw_only=True):
    """What the router observed over the planner's window."""
    arrival_rate: float = 0.0  # requests per second
    mean_input_tokens: float = 0.0
    # the prompt lengths' deciles (the middle of each tenth, p5 ... p95): prefill cost is convex in the
    # length, so a heavy-tailed mix costs more than its mean prompt; empty: unknown
    input_tokens_deciles: list[int] = []
    mean_output_tokens: float = 0.0
    # the arrival rate that prompts meet, over the window's: the 90th percentile, over the arrivals of the burst
    # history, of the rate in the TTFT-SLO-long span around each, divided by arrival_rate (>= 1). Prompts of a
    # burst queue for prefill together; an answer's decode averages over its many steps
    prefill_peak_ratio: float = 1.0
    completed: int = 0
    # the seconds of arrivals the window holds (less than the window over the router's first seconds); None: unknown,
    # taken as the whole window
    span_s: Optional[float] = None
    # arrivals a second over the last ANSWER_COHORT_S (10) seconds: the newest mix's rate, where the window straddles
    # a shift (queued.queued_mix)
    recent_arrival_rate: float = 0.0
    # the mean prompt of the requests the workers received over the last ANSWER_COHORT_S seconds (received.py); 0:
    # unknown (fewer than MIN_RECEIVED_SAMPLES, or a worker that does not count them)
    recent_input_tokens: float = 0.0
    # how many requests the workers received over the last ANSWER_COHORT_S seconds, and their mean prompt, however
    # few (0: none, or a worker that does not count them): on a small cluster the newest mix's prompts
    # (queued.queued_mix)
    recent_prompts: int = 0
    recent_prompt_mean: float = 0.0
    # mean_output_tokens is the answers of the last ANSWER_COHORT_S seconds' arrivals (window._mean_answer: they say
    # ANSWER_SHIFT times the finished requests' or more, or it is the router's first window): the newest mix's own
    recent_answers: bool = False
    # the mixes of past windows, newest first: [mean prompt, mean answer] of a window's finished requests, one per
    # window length, kept across shifts of the mix. The planner takes the nearest in prompt length for the answers of
    # prompts it sees queued and the window has not seen finish (queued.queued_mix)
    past_mixes: list[list[float]] = []
    # observed latencies by path (PD_PATH, NULL_PATH), seconds; absent: no streamed request finished
    ttft_s: dict[str, float] = {}
    tpot_s: dict[str, float] = {}


class PathPrediction(msgspec.Struct, kw_only=True):
    share: float  # of the arrivals
    ttft_s: float
    tpot_s: float
    score: float  # max(ttft / ttft_slo, tpot / tpot_slo)


class Prediction(msgspec.Struct, kw_only=True):
    pools: dict[str, int]  # mode -> number of workers
    paths: dict[str, PathPrediction]
    score: float  # the worst path's score; below 1: every SLO met; lower is better
    # the largest multiple of the arrival rate (same mix) at which the layout meets both SLOs; 0: at none
    # searched (or not computed)
    capacity: float = 0.0
    # the prefill backlog (queued prefill tokens) against the prefill side's pace at full steps while today's rate
    # keeps arriving, on the path where it clears last: the seconds until it is worked off (0 without a backlog,
    # NEVER when it is not, or when a path without one falls behind the arrivals and grows one), and the prompts a
    # second the pace passes beyond the arrivals (negative: it grows); None: not predicted
    recovery_s: Optional[float] = None
    drain_rate: Optional[float] = None
    note: str = ""


class Candidate(msgspec.Struct, kw_only=True):
    url: str
    src: str
    dst: str
    legal: bool
    reason: str = ""  # why it is not legal
    prediction: Optional[Prediction] = None  # of the layout heading_for the moves in flight, plus this one


class Decision(msgspec.Struct, kw_only=True):
    at: float  # the planner clock (seconds)
    # "move", "hold", or "advise" (a move --planner advise would start, not started); in the status's history also
    # "hand": a move by hand (the router's /admin/set_worker_role, or a worker switched on its own route), no decision
    kind: str
    reason: str
    # a hold's cause, stable for counting: static, no_observations, no_arrivals, no_lengths, no_layout,
    # at_best, gain_too_small, moves_in_flight, no_legal_move ("" for a move)
    why: str = ""
    url: str = ""
    src: str = ""
    dst: str = ""
    current: Optional[Prediction] = None
    best: Optional[Candidate] = None
    candidates: list[Candidate] = []
    target: Optional[Prediction] = None  # the best layout found, which the moves head for
    outcome: str = ""  # for moves, once done: "ok" or "failed: ..."
    # a move that landed: the worker's own timings of its switch (drain, switch; ms), drain 0 for a handover,
    # and its message (how many requests it handed over, if it did)
    timings_ms: dict[str, float] = {}
    worker_message: str = ""
    answers: Optional[float] = None  # a move's: the mean answer of the traffic it was decided on
    # a hold or advice: the rounds in a row before it that decided the same on the same pools (the status's history
    # keeps the newest of them, `at` its time)
    repeats: int = 0


class PlannerConfig(msgspec.Struct, kw_only=True):
    # "static": never moves; "sla": moves toward the SLOs; "advise": decides as sla, and reports each move it would
    # start (a decision of kind "advise") without starting it
    mode: str = "static"
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    interval_s: float = 5.0
    cooldown_s: float = 30.0  # after a move, before one that undoes it
    worker_cooldown_s: Optional[float] = None  # after a worker's move, before it moves again (None: 3x cooldown)
    min_per_pool: int = 1  # prefill and decode pools never shrink below this (null may empty)
    max_concurrent_moves: int = 1
    # a target must raise the capacity by this fraction (or, where no layout meets the SLOs at any rate,
    # lower the score by this much and by 10% of it)
    hysteresis: float = 0.3
    window_s: float = 30.0
    # the burst history (Traffic.prefill_peak_ratio) spans this long, back to the last shift of the mix at most
    # (a mix that comes back brings its last history's peak until then): a bursty trace's bursts are minutes
    # apart, so most windows of window_s see none
    burst_window_s: float = 300.0
    backoff_base_s: float = 30.0  # after a failed move of a worker; doubles per failure
    backoff_max_s: float = 600.0
    # a decode worker moved to prefill or null, a null worker to prefill: "handover" switches it at once and
    # it finishes what it held in the new role (roles/handover.py); "drain" switches it once that has ended;
    # "migrate" drains it for migrate_after_s, then moves what still runs to the other decode workers
    # (roles/migration.py; with no other decode worker it drains)
    decode_move: str = "handover"
    migrate_after_s: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in PLANNER_MODES:
            raise ValueError(f"--planner must be one of {', '.join(PLANNER_MODES)}, got {self.mode!r}")
        if self.decode_move not in DECODE_MOVES:
            raise ValueError(f"--planner-decode-move must be one of {', '.join(DECODE_MOVES)}, "
                             f"got {self.decode_move!r}")
        # `not x > 0` (not `x <= 0`) so that NaN is refused too; infinity only where it means "never"
        for flag, value in (("--ttft-slo-ms", self.ttft_slo_s * 1000), ("--tpot-slo-ms", self.tpot_slo_s * 1000),
                            ("--planner-window-s", self.window_s), ("--planner-burst-window-s", self.burst_window_s),
                            ("--planner-migrate-after-s", self.migrate_after_s)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{flag} must be a positive number, got {value:g}")
        if not (MIN_INTERVAL_S <= self.interval_s < math.inf):
            raise ValueError(f"--planner-interval-s must be at least {MIN_INTERVAL_S:g} s (a decision predicts every "
                             f"layout of the cluster), got {self.interval_s:g}")
        for flag, value in (("--planner-cooldown-s", self.cooldown_s), ("--planner-hysteresis", self.hysteresis),
                            ("--planner-worker-cooldown-s", 0.0 if self.worker_cooldown_s is None
                             else self.worker_cooldown_s)):
            if not value >= 0:
                raise ValueError(f"{flag} must be >= 0, got {value:g}")
        if self.min_per_pool < 0:
            raise ValueError(f"--planner-min-per-pool must be >= 0, got {self.min_per_pool}")
        if self.max_concurrent_moves < 1:
            raise ValueError(f"--planner-max-concurrent-moves must be >= 1, got {self.max_concurrent_moves}")

    @property
    def per_worker_cooldown_s(self) -> float:
        return 3 * self.cooldown_s if self.worker_cooldown_s is None else self.worker_cooldown_s
