"""What the prompts queued for prefill, or the newest arrivals, say of the mix where the window has not seen it
finish (pure, no I/O)."""

from __future__ import annotations

import math
from typing import Optional

import msgspec

from tidal.planner.predict import PoolLoad
from tidal.planner.schema import NULL, PREFILL, Traffic
from tidal.planner.window import scaled

# the prompts waiting for prefill stand for the mix (`queued_mix`) when at least this many wait and their mean
# differs from the window's by this factor, either way
QUEUED_SAMPLE = 20
QUEUED_SHIFT = 1.5
# where fewer prompts wait, the newest arrivals stand for the mix once at least this many arrived (`arrivals_sample`)
ARRIVALS_SAMPLE = 4
# a past window of the window's own kind of answers vetoes the queued prompts' lookup only within this many
# standard errors of the queued prompts' mean: a long queue is not a sample of windows further off
SAMPLING_Z = 2.0
# answers within this factor are of one kind of request. On the Azure traces at x0.25 a window's answers are
# 4-12 tokens on code and 33-75 on conversation, the conversation trace's bursts and lulls 2.03x apart at most
# (33 / 67 at 64 instances on the wall clock); the two kinds 2.7x at their nearest (12.1 / 33), 8-10x by the means
SAME_ANSWERS = 3.0


def same_kind(answer: float, other: float) -> bool:
    """Whether two mean answers, both known, are of one kind of request (within SAME_ANSWERS of each other)."""
    return answer > 0 and other > 0 and abs(math.log(answer / other)) <= math.log(SAME_ANSWERS)


def queued_mix(load: PoolLoad, traffic: Traffic) -> tuple[Traffic, str]:
    """The window's traffic, with the newest prompts as its prompt lengths when they are another mix (and a note
    saying so). The window knows a prompt's length once its request has finished: when the mix turns to longer
    prompts, the new ones wait behind the backlog they cause, and the window shows the old mix until they finish
    (on a mix shifting from 75- to 450-token prompts it said 95-246 tokens over the next 30 s while the prefill
    pool fell behind). The newest prompts are those waiting for prefill (`queued_sample`) or, where too few wait,
    those the workers received over the last seconds (`arrivals_sample`); as the mix: the deciles scaled alike,
    the answers those of the past window whose prompts were nearest theirs (`seen_answers`), and the rate the
    last seconds' (the window straddles the shift)."""
    if traffic.mean_input_tokens <= 0:
        return traffic, ""
    sample = queued_sample(load, traffic) or arrivals_sample(traffic)
    if sample is None:
        return traffic, ""
    prompt, count, note = sample
    ratio = prompt / traffic.mean_input_tokens
    veto = sampling_radius(traffic.input_tokens_deciles, count)
    answers = None if traffic.recent_answers else seen_answers(prompt, traffic.past_mixes, traffic.mean_output_tokens,
                                                                veto)
    if answers is None:
        answers = traffic.mean_output_tokens
    else:
        note += (f", answers of {answers:.0f} as a past window's of such prompts "
                 f"(the window's {traffic.mean_output_tokens:.0f})")
    rate = traffic.recent_arrival_rate or traffic.arrival_rate
    if rate != traffic.arrival_rate:
        note += f", {rate:.1f} requests/s over the last seconds (the window's {traffic.arrival_rate:.1f})"
    return msgspec.structs.replace(
        traffic, arrival_rate=rate, mean_input_tokens=prompt, mean_output_tokens=answers,
        input_tokens_deciles=scaled(traffic.input_tokens_deciles, ratio)), note


def queued_sample(load: PoolLoad, traffic: Traffic) -> Optional[tuple[float, int, str]]:
    """(mean prompt, how many, note) of the prompts waiting on prefill and null workers, when at least
    QUEUED_SAMPLE wait and their mean differs from the window's by QUEUED_SHIFT, either way, unless the newest
    arrivals' prompts as the workers received them are the window's (`arrivals_are_the_windows`). The waiting
    prompts are the newest arrivals (first come, first served unless priorities reorder them); they are the
    waiting requests' own (`/get_load`'s num_waiting_prompt_tokens); where a worker does not report them, the
    tokens queued for prefill stand in, a rough mean: they count the rest of a prompt being prefilled in chunks
    (not a waiting request)."""
    waiting = load.waiting[PREFILL] + load.waiting[NULL]
    queued = queued_prompt_tokens(load)
    if waiting < QUEUED_SAMPLE or queued <= 0:
        return None
    prompt = queued / waiting
    ratio = prompt / traffic.mean_input_tokens
    if 1 / QUEUED_SHIFT < ratio < QUEUED_SHIFT or arrivals_are_the_windows(traffic):
        return None
    return prompt, waiting, (f"; prompts of {prompt:.0f} tokens as queued ({waiting} waiting; "
                             f"the window's {traffic.mean_input_tokens:.0f})")


def arrivals_sample(traffic: Traffic) -> Optional[tuple[float, int, str]]:
    """(mean prompt, how many, note) of the requests the workers received over the last seconds
    (`Traffic.recent_prompts`), where fewer than QUEUED_SAMPLE arrived (no queue of QUEUED_SAMPLE can form in
    the seconds that matter), at least ARRIVALS_SAMPLE did, and their mean lies beyond both QUEUED_SHIFT and the
    window's sampling spread at so few (`sampling_spread`) from the window's mean, either way. On three servers at
    one request a second a turn from 32- to 768-token prompts queued no 20 prompts, and the window said the old mix
    for 20 s while the one prefill server fell behind (live run 27). Where more arrive, the queue decides as
    before: the newest arrivals' prompts alone, paired with the window's answers, turned 64 instances toward prefill
    at a turn to the conversation trace (azure-shift, 10 s of 344-token prompts against the code window's 541) and
    cost a grid step of goodput."""
    count, prompt = traffic.recent_prompts, traffic.recent_prompt_mean
    if not ARRIVALS_SAMPLE <= count < QUEUED_SAMPLE or prompt <= 0:
        return None
    ratio = prompt / traffic.mean_input_tokens
    spread = max(QUEUED_SHIFT, sampling_spread(traffic.input_tokens_deciles, count))
    if 1 / spread < ratio < spread:
        return None
    return prompt, count, (f"; prompts of {prompt:.0f} tokens as received over the last seconds ({count} arrived; "
                           f"the window's {traffic.mean_input_tokens:.0f})")


def arrivals_are_the_windows(traffic: Traffic) -> bool:
    """Whether the prompts the workers received over the last seconds (`Traffic.recent_input_tokens`, where known)
    lie within QUEUED_SHIFT of the window's mean prompt: the newest arrivals are then the window's mix, and a queue
    that differs is a biased sample of it, not a new mix. Which prompts wait depends on the workers, not only on
    the mix: on the even mix at 64 instances at TTFT 16 s (rate scale 29.94, t = 460 s, a lull of a code phase)
    31 prompts of 177 tokens waited (median 56), where the last 10 s's 457 arrivals averaged 528 (median 369); a
    conversation window's answers stood for them, and 24 workers moved to decode ahead of a code burst."""
    recent = traffic.recent_input_tokens
    return recent > 0 and traffic.mean_input_tokens > 0 and (
        1 / QUEUED_SHIFT < recent / traffic.mean_input_tokens < QUEUED_SHIFT)


def queued_prompt_tokens(load: PoolLoad) -> int:
    """The prompt tokens of the requests waiting on prefill and null workers: their own where every such worker
    reports them, else the tokens queued for prefill."""
    prefill, null = load.waiting_prompt_tokens[PREFILL], load.waiting_prompt_tokens[NULL]
    if prefill is not None and null is not None:
        return prefill + null
    return load.queued_prefill_tokens[PREFILL] + load.queued_prefill_tokens[NULL]


def sampling_radius(deciles: list[int], waiting: int) -> float:
    """`sampling_spread`, at most QUEUED_SHIFT."""
    return min(QUEUED_SHIFT, sampling_spread(deciles, waiting))


def sampling_spread(deciles: list[int], count: int) -> float:
    """The factor within which the mean of `count` prompts drawn from the window's prompt lengths (`deciles`)
    lies at SAMPLING_Z standard errors; QUEUED_SHIFT where the deciles are unknown."""
    if not deciles or count <= 0:
        return QUEUED_SHIFT
    mean = sum(deciles) / len(deciles)
    if mean <= 0:
        return QUEUED_SHIFT
    cv = math.sqrt(sum((x - mean) ** 2 for x in deciles) / len(deciles)) / mean
    return math.exp(SAMPLING_Z * cv / math.sqrt(count))


def seen_answers(prompt: float, past_mixes: list[list[float]], window_answer: float = 0.0,
                 veto_radius: float = QUEUED_SHIFT) -> Optional[float]:
    """The mean answer of the past window whose mean prompt was nearest `prompt` (by ratio; the newest among
    equals), if within QUEUED_SHIFT of it and of another kind than the window's own (answers not within
    SAME_ANSWERS of `window_answer`); None if no window is, if the nearest is of the window's own kind, or if a past
    window of the window's own kind lies within `veto_radius` of `prompt`: such prompts came with the window's kind
    of answers before, so they do not tell another mix. A mix's kinds of request differ in both lengths (code
    completion: long prompts, short answers; chat: the reverse), and queued requests' answers are not known before
    they end; where the kinds' prompts overlap (the Azure code and conversation traces, x0.25: 300-500 and 310-330
    tokens a window) a heavy-tailed queue of the window's own mix lands near the other kind's prompts. The radius is
    how far the queue's mean may lie from its kind's windows by sampling alone (`sampling_radius`): a long queue far
    from every window of the window's kind is another mix."""
    best = None
    for seen_prompt, answer in past_mixes:
        if seen_prompt <= 0:
            continue
        off = abs(math.log(prompt / seen_prompt))
        if off >= math.log(QUEUED_SHIFT):
            continue
        if same_kind(answer, window_answer) and off < math.log(veto_radius):
            return None
        if best is None or off < best[0]:
            best = (off, answer)
    return None if best is None or same_kind(best[1], window_answer) else best[1]
