"""Speculative decoding: proposers guess the next tokens of running requests, one target
pass verifies every guess of the batch, and the scheduler keeps what the target agrees
with (and frees the KV of the rest).

Verification samples every row of a request's guess with the request's own sampler
(temperature, top-k/top-p/min-p, penalties, seeds: each row as if the tokens before it
were already output) and keeps the guesses up to the first row whose sample differs, plus
that row's sample. For proposals that are a single token per position (prompt lookup,
greedy drafts) this is exactly rejection sampling: a guess d is kept with probability
p(d), and a rejected row's token is distributed as p with d removed and renormalised, so
the output keeps the target's distribution; greedy output equals non-speculative output.
"""
