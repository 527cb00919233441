"""IncrementalDetokenizer against the real default tokenizer (SmolLM2, byte-level BPE)."""

from __future__ import annotations

import random

import pytest

from fake_scheduler import cached_tokenizer_dir
from tidal.messages import FinishReason
from tidal.server.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

EOS = 2
DOT = 30  # "."
LENGTH = FinishReason(type="length")


@pytest.fixture(scope="module")
def tok():
    from tidal.server.tokenizer_manager import _fallback_load_tokenizer

    return _fallback_load_tokenizer("", cached_tokenizer_dir())


def run(tok, ids, finish, chunk_sizes=None, **kw):
    """Feed ids in chunks (the finish reason with the last one); return (chunks, detok)."""
    d = IncrementalDetokenizer(tok, tok.encode("Say:"), **kw)
    sizes = chunk_sizes or [1] * len(ids)
    chunks, pos = [], 0
    for k, n in enumerate(sizes):
        part = ids[pos:pos + n] if k < len(sizes) - 1 else ids[pos:]
        pos += n
        chunks.append(d.feed(part, finish if k == len(sizes) - 1 else None))
    return chunks, d


@pytest.mark.parametrize("text", ["héllo 你好 🎉 world", "naïve café 👨\u200d👩\u200d👧 ok"])
def test_multibyte_streaming(tok, text):
    ids = tok.encode(text)
    assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids)  # really split mid-character
    chunks, d = run(tok, ids, LENGTH)
    assert all(REPLACEMENT_CHAR not in c for c in chunks)
    assert "".join(chunks) == d.text == text


def test_emoji_held_back_until_complete(tok):
    ids = tok.encode("ok 🎉")
    d = IncrementalDetokenizer(tok)
    released = [d.feed([i]) for i in ids[:-1]]
    assert "".join(released) == "ok"  # the emoji's partial bytes are not released
    assert d.feed(ids[-1:]) == " 🎉"


def test_random_chunking_concat_equals_final(tok):
    text = "Grüße aus Köln 🎉🎉 — 東京 and more words here."
    ids = tok.encode(text)
    rng = random.Random(0)
    for _ in range(5):
        sizes = [rng.randint(1, 4) for _ in range(len(ids))]
        chunks, d = run(tok, ids, LENGTH, sizes)
        assert "".join(chunks) == d.text == text


def test_stop_string_trimmed(tok):
    ids = tok.encode("Hello world. STOP here")  # ... " ST", "OP", " here"
    stop_at = ids.index(tok.encode(" ST")[0]) + 2  # the scheduler stops after "OP"
    chunks, d = run(tok, ids[:stop_at], FinishReason(type="stop", matched="STOP"), stop=["STOP"])
    assert d.text == "Hello world. "
    assert "".join(chunks) == d.text
    assert all("ST" not in c for c in chunks)  # the stop prefix was never streamed


def test_stop_prefix_released_when_not_a_stop(tok):
    d = IncrementalDetokenizer(tok, stop=["world!"])
    hello, world, qmark = tok.encode("Hello world?")
    assert d.feed([hello]) == "Hello"
    assert d.feed([world]) == " "  # "world" may start "world!": held back
    assert d.feed([qmark]) == "world?"
    assert d.feed([], LENGTH) == ""
    assert d.text == "Hello world?"


def test_no_stop_trim_keeps_everything(tok):
    ids = tok.encode("Hello world. STOP here")
    chunks, d = run(tok, ids, FinishReason(type="stop", matched="STOP"), stop=["STOP"], no_stop_trim=True)
    assert d.text == "Hello world. STOP here" == "".join(chunks)


def test_stop_token_id_text_excluded(tok):
    ids = tok.encode("a.b") + [DOT]
    chunks, d = run(tok, ids, FinishReason(type="stop", matched=DOT))
    assert d.text == "a.b" == "".join(chunks)
    _, kept = run(tok, ids, FinishReason(type="stop", matched=DOT), no_stop_trim=True)
    assert kept.text == "a.b."


def test_eos_excluded_even_without_skipping_special_tokens(tok):
    ids = tok.encode("Hi there") + [EOS]
    _, d = run(tok, ids, FinishReason(type="stop", matched=EOS), skip_special_tokens=False)
    assert d.text == "Hi there"


def test_skip_special_tokens(tok):
    ids = [1] + tok.encode("user") + [2]
    _, skipped = run(tok, ids, LENGTH)
    _, kept = run(tok, ids, LENGTH, skip_special_tokens=False)
    assert skipped.text == "user"
    assert kept.text == "<|im_start|>user<|im_end|>"


def test_length_finish_flushes_partial_character(tok):
    ids = tok.encode("x 🎉")[:-1]  # cut inside the emoji
    chunks, d = run(tok, ids, LENGTH)
    assert d.text.startswith("x") and d.text.endswith(REPLACEMENT_CHAR)
    assert "".join(chunks) == d.text


def test_feed_after_finish_is_ignored(tok):
    d = IncrementalDetokenizer(tok)
    d.feed(tok.encode("done"), LENGTH)
    assert d.feed(tok.encode(" more")) == "" and d.text == "done"
