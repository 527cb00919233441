"""Constrained decoding: grammars from sampling parameters, compiled off the scheduler loop,
applied to the logits as batched token masks (llguidance)."""
