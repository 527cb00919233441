"""Per-request limits: the body size (an ASGI middleware, before any parsing) and the
counts a request may ask for (n, prompts per request), checked before tokenizing.

The limits come from ServerArgs (`--max-request-body-bytes`, `--max-n`, ...).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from tidal.server.protocol import ApiError, JSONResp


def body_too_large(limit: int) -> ApiError:
    return ApiError(f"The request body is larger than the server's limit of {limit} bytes "
                    "(--max-request-body-bytes).", 413)


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes`: at once from Content-Length, or while a chunked
    body streams in (the app's read fails at the chunk that crosses the limit, so no
    more than `max_bytes` plus one chunk is ever buffered)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            err = body_too_large(self.max_bytes)
            return await JSONResp(err.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)
        if declared is not None:  # h11/httptools never deliver more than Content-Length
            return await self.app(scope, receive, send)
        return await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Any) -> Any:
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise body_too_large(self.max_bytes)
            return msg

        return counted


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server rejects a malformed one before the app runs
    return None


def check_prompt_count(count: int, limit: int) -> None:
    if count > limit:
        raise ApiError(f"The request has {count} prompts; the limit is {limit} (--max-batch-size-per-request).")


def check_n(n: int, limit: int) -> None:
    if n > limit:
        raise ApiError(f"n is {n}; the limit is {limit} (--max-n).")


def check_top_logprobs(num: int, limit: int) -> None:
    if not 0 <= num <= limit:
        raise ApiError(f"The number of top logprobs must be in [0, {limit}] (--max-logprobs), got {num}.")


def check_stop(stop: list, max_count: int, max_chars: int) -> None:
    if len(stop) > max_count:
        raise ApiError(f"The request has {len(stop)} stop strings; the limit is {max_count} (--max-stop-strings).")
    longest = max((len(s) for s in stop if isinstance(s, str)), default=0)
    if longest > max_chars:
        raise ApiError(f"A stop string has {longest} characters; the limit is {max_chars} (--max-stop-string-chars).")


def max_chars_per_token(tokenizer: Any) -> Optional[int]:
    """The most characters of input text one token can stand for, where that is provable;
    None otherwise.

    A byte-level BPE tokenizer without a normalizer splits the text's UTF-8 bytes among
    its tokens: a vocabulary token covers len(token) bytes (one byte-level character per
    byte), an added token its own content (unless it strips whitespace around itself,
    which has no bound). A character is at least one byte, so a text of C characters has
    at least C / max_chars_per_token tokens.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # not a `tokenizers` Tokenizer: no claim
        return None
    if spec.get("normalizer") is not None or not _is_byte_level(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    lengths = [len(t) for t in backend.get_vocab(with_added_tokens=False)]
    lengths += [len(a["content"].encode("utf-8")) for a in added]
    return max(lengths, default=None)


def _is_byte_level(pre: Optional[dict]) -> bool:
    if not pre:
        return False
    if pre.get("type") == "Sequence":
        return any(_is_byte_level(p) for p in pre.get("pretokenizers") or ())
    return pre.get("type") == "ByteLevel"
