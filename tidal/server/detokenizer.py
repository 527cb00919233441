"""Incremental detokenization: turn a growing list of token ids into stable text.

Only text that can no longer change is released: a tail that decodes to U+FFFD (an
incomplete multi-byte character split across tokens) is held back, and so is a tail
that could be the start of a stop string (it would be trimmed if the stop completes).
Because the released text only ever grows, the streamed chunks concatenated equal
the final text, by construction.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from tidal.messages import FinishReason

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded together with the output so that the first output token
# decodes as it does in context (SentencePiece drops a leading space otherwise).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.no_stop_trim = no_stop_trim
        self._ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix = 0  # window start in _ids
        self._read = len(self._ids)  # end of the ids whose text is already in _text
        self._text = ""  # decoded output text, possibly ahead of what was released
        self.released = 0  # len of the stable prefix of _text
        self.finished = False

    @property
    def text(self) -> str:
        """The stable text so far (the final text once finished)."""
        return self._text[: self.released]

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> None:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR)):
            return
        self._text += full_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)

    def _stop_holdback(self) -> int:
        """Length of the longest tail of _text that is a proper prefix of a stop string."""
        if not self.stop or self.no_stop_trim:
            return 0
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:k]):
                    best = k
                    break
        return best

    def feed(self, new_ids: Sequence[int], finish_reason: Optional[FinishReason] = None) -> str:
        """Add the tokens of one scheduler output; return the newly released text."""
        if self.finished:
            return ""
        before = self.released
        ids = list(new_ids)
        if finish_reason is not None and self._trims_stop_token(finish_reason) and ids:
            ids = ids[:-1]  # the stop token's own text is not part of the output
        if ids:
            self._ids.extend(ids)
            self._advance(final=finish_reason is not None)
        if finish_reason is not None:
            if len(self._ids) > self._read:
                self._advance(final=True)
            self._finish(finish_reason)
        else:
            self.released = max(self.released, len(self._text) - self._stop_holdback())
        return self._text[before : self.released]

    def _trims_stop_token(self, fr: FinishReason) -> bool:
        return fr.type == "stop" and isinstance(fr.matched, int) and not self.no_stop_trim

    def _finish(self, fr: FinishReason) -> None:
        self.finished = True
        end = len(self._text)
        if fr.type == "stop" and isinstance(fr.matched, str) and fr.matched and not self.no_stop_trim:
            idx = self._text.find(fr.matched, self.released)
            if idx < 0:
                idx = self._text.rfind(fr.matched)
            if idx >= 0:
                end = max(idx, self.released)
        self._text = self._text[:end]
        self.released = end


def decode_tokens(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The text of each token alone (for logprob entries)."""
    return [tokenizer.decode([int(i)], skip_special_tokens=False) for i in ids]
