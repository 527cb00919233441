"""KV-aware routing: the router follows each worker's KV events (tidal.kvevents) into an exact index of the
blocks its prefix cache holds, tokenizes each prompt as the workers do, and sends it where the least prefill
work waits for it.

Cost of worker w for a prompt of n tokens (both terms in prompt tokens):
    n - matched_blocks(w) * block_size            the tokens w would still have to prefill
  + load_weight * load_score(w) * mean_prompt     its queue, each open request counted as a mean prompt
The lowest cost wins; ties go to the less loaded worker, then to the one holding fewer blocks (new prefixes
spread). While any candidate's view is not in sync (no events config, a hole being replayed, a restart) or the
prompt could not be tokenized, the policy asks its fallback (cache_aware over the text) instead, and it feeds
the fallback's tree on every pick, so that a fallback starts warm.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Optional, Sequence

from tidal.kvevents.events import block_hashes
from tidal.kvevents.subscriber import KVBlockIndex, WorkerSubscription
from tidal.router.policies import CacheAwarePolicy, Policy, PromptTokens
from tidal.router.workers import Worker

logger = logging.getLogger(__name__)

PREDICT_S = 10.0  # how long a routed prompt's blocks count as on their way into the worker's cache
PREDICTED_SWEEP = 1 << 16  # predicted blocks per worker beyond which the expired ones are dropped
INLINE_TOKENIZE_CHARS = 32 * 1024  # longer prompts are tokenized in a thread, off the event loop
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


def subscriber_endpoint(endpoint: Optional[str], worker_host: str) -> Optional[str]:
    """Where the router connects for an endpoint a worker bound: a wildcard bind is reached at the worker's
    own host."""
    if not endpoint or not endpoint.startswith("tcp://"):
        return endpoint
    hostport = endpoint[len("tcp://"):]
    host, _, port = hostport.rpartition(":")
    if host in _WILDCARD_HOSTS and worker_host:
        host = f"[{worker_host}]" if ":" in worker_host else worker_host
    return f"tcp://{host}:{port}"


class KVEventsFollower:
    """One subscription per worker that publishes KV events, learned from its /server_info `kv_events`; the
    shared index the kv_aware policies of every pool read."""

    def __init__(self) -> None:
        self.index = KVBlockIndex()
        self._subs: dict[str, WorkerSubscription] = {}
        self._seen: dict[str, tuple] = {}  # url -> (endpoint, replay endpoint, topic, boot id) subscribed to
        self.block_sizes: dict[str, int] = {}

    def learn(self, w: Worker, info: Any) -> None:
        """Follow what the worker's /server_info says it publishes (a new boot id or endpoint: subscribe anew,
        the old view is dropped; nothing: stop following)."""
        kv = info.get("kv_events") if isinstance(info, dict) else None
        if not isinstance(kv, dict) or not kv.get("endpoint") or not isinstance(kv.get("block_size"), int):
            if w.url in self._subs:
                logger.info("worker %s publishes no KV events any more", w.url)
            self.forget(w.url)
            return
        endpoint = subscriber_endpoint(kv["endpoint"], w.host)
        replay = subscriber_endpoint(kv.get("replay_endpoint"), w.host)
        key = (endpoint, replay, kv.get("topic") or "", info.get("boot_id"))
        if self._seen.get(w.url) == key:
            return
        self.forget(w.url)
        if replay is None:
            logger.warning("worker %s publishes KV events without a replay_endpoint: a router that joins late or "
                           "loses a batch cannot resync, and routes it by the text tree", w.url)
        self.block_sizes[w.url] = kv["block_size"]
        self._seen[w.url] = key
        self._subs[w.url] = WorkerSubscription(w.url, endpoint, replay, self.index, topic=key[2])
        logger.info("following the KV events of %s at %s (replay %s)", w.url, endpoint, replay)

    def synced(self, url: str) -> bool:
        return url in self._subs and self.index.synced(url)

    def matched_tokens(self, url: str, tokens: Sequence[int], namespace: Any,
                       hashes_by_size: dict[int, list[int]]) -> int:
        size = self.block_sizes[url]
        hashes = hashes_by_size.get(size)
        if hashes is None:
            hashes = hashes_by_size[size] = block_hashes(tokens, size, namespace=namespace)
        return self.index.matched_blocks(url, hashes) * size

    def forget(self, url: str) -> None:
        sub = self._subs.pop(url, None)
        if sub is not None:
            sub.close()
        self._seen.pop(url, None)
        self.block_sizes.pop(url, None)
        self.index.forget(url)

    def close(self) -> None:
        for url in list(self._subs):
            self.forget(url)

    def state(self, url: str) -> Optional[dict]:
        """For GET /workers: whether the view is in sync, its size, how often it was repaired."""
        sub = self._subs.get(url)
        if sub is None:
            return None
        return {"synced": self.index.synced(url), "blocks": self.index.size(url), "replays": sub.replays,
                "snapshots": sub.snapshots, "endpoint": sub.endpoint}


class KVAwarePolicy(Policy):
    name = "kv_aware"
    wants_tokens = True

    def __init__(self, follower: Optional[KVEventsFollower], fallback: CacheAwarePolicy,
                 load_weight: float = 1.0, predict_s: float = PREDICT_S) -> None:
        self.follower = follower
        # url -> {block hash: until when}: the blocks of prompts sent there whose events may not have come yet
        # (a prompt is stored once its prefill ends): what the next prompt of a burst sharing its prefix sees
        self.predicted: dict[str, dict[int, float]] = {}
        self.predict_s = predict_s
        self.fallback = fallback
        self.load_weight = load_weight
        self.mean_prompt = 0.0  # tokens, an exponential mean over the prompts routed
        self.routed = self.fallbacks = 0
        self.cached_tokens = self.prompt_tokens = 0  # what the picks were expected to find cached, of how many

    def select(self, workers: Sequence[Worker], text: str = "", tokens: Optional[PromptTokens] = None) -> Worker:
        f = self.follower
        if tokens is None or f is None or not all(f.synced(w.url) for w in workers):
            self.fallbacks += 1
            return self.fallback.select(workers, text)
        n = len(tokens.ids)
        self.mean_prompt = n if not self.routed else 0.9 * self.mean_prompt + 0.1 * n
        self.routed += 1
        hashes: dict[int, list[int]] = {}
        now = time.monotonic()
        matched = {w.url: self._matched(w.url, tokens, hashes, now) for w in workers}
        queue_cost = self.load_weight * self.mean_prompt
        chosen = min(workers, key=lambda w: (n - matched[w.url] + queue_cost * w.load_score(), w.load_score(),
                                             f.index.size(w.url), w.url))
        self.cached_tokens += matched[chosen.url]
        self.prompt_tokens += n
        size = f.block_sizes.get(chosen.url)
        if size in hashes:
            mine = self.predicted.setdefault(chosen.url, {})
            if len(mine) > PREDICTED_SWEEP:  # expired entries are only ignored by lookups: drop them now and then
                for h in [h for h, until in mine.items() if until < now]:
                    del mine[h]
            mine.update(dict.fromkeys(hashes[size], now + self.predict_s))
        if text:
            self.fallback.index.insert(text, chosen.url)
        return chosen

    def _matched(self, url: str, tokens: PromptTokens, hashes: dict[int, list[int]], now: float) -> int:
        """Tokens of the prompt's prefix the worker holds, or will once the prompts sent to it are stored."""
        f = self.follower
        held = f.matched_tokens(url, tokens.ids, tokens.namespace, hashes)
        mine = self.predicted.get(url)
        if not mine:
            return held
        size = f.block_sizes[url]
        predicted = 0
        for h in hashes[size]:
            if mine.get(h, 0.0) < now:  # never sent there, or expired
                break
            predicted += size
        return max(held, predicted)

    def forget(self, url: str) -> None:
        self.fallback.forget(url)
        self.predicted.pop(url, None)

    def stats(self) -> dict:
        return {"routed": self.routed, "fallbacks": self.fallbacks, "expected_cached_tokens": self.cached_tokens,
                "prompt_tokens": self.prompt_tokens}


# ---------------------------------------------------------------- the router's tokenizer


class PromptTokenizer:
    """Tokenizes a request's prompt as a tidal worker does, for kv_aware: /generate `input_ids` as given, its
    `text` with special tokens; /v1/completions' prompt likewise; chat through the model's template and then
    without special tokens. None (the policy falls back) where a prompt is a batch, is not text, or fails."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, path: str) -> "PromptTokenizer":
        from tidal.model.tokenizer import load_tokenizer

        return cls(load_tokenizer(path))

    async def tokens(self, route: str, body: dict) -> Optional[PromptTokens]:
        ids = await self._ids(route, body)
        return PromptTokens(ids, request_namespace(route, body)) if ids is not None else None

    async def _ids(self, route: str, body: dict) -> Optional[list[int]]:
        text, special = self._prompt(route, body)
        if isinstance(text, list):  # token ids as given; a batch of texts has no single prompt
            return text if text and all(type(t) is int for t in text) else None
        if not isinstance(text, str):
            return None
        try:
            if len(text) <= INLINE_TOKENIZE_CHARS:
                return self._encode(text, special)
            return await asyncio.to_thread(self._encode, text, special)
        except Exception as e:  # noqa: BLE001 - a prompt the router cannot tokenize is routed by its text
            logger.debug("kv_aware: cannot tokenize a %s prompt: %s", route, e)
            return None

    def _encode(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def _prompt(self, route: str, body: dict) -> tuple[Any, bool]:
        if route == "/generate":
            ids = body.get("input_ids")
            return (ids if ids is not None else body.get("text")), True
        if route == "/v1/chat/completions":
            return self._chat_text(body), False
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        return prompt, True

    def _chat_text(self, body: dict) -> Optional[str]:
        from tidal.server.tool_calls import template_message

        messages = body.get("messages")
        if not isinstance(messages, list) or not getattr(self.tokenizer, "chat_template", None):
            return None
        msgs = []
        for m in messages:
            if not isinstance(m, dict):
                return None
            d = {k: v for k, v in m.items() if v is not None}
            if isinstance(d.get("content"), list):
                d["content"] = "".join(p.get("text", "") for p in d["content"] if isinstance(p, dict))
            d.setdefault("content", "")
            msgs.append(template_message(d))
        try:
            return self.tokenizer.apply_chat_template(msgs, tools=body.get("tools"), tokenize=False,
                                                      add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - the worker answers the template's error itself
            return None


def request_namespace(route: str, body: dict) -> Optional[str]:
    """The prefix namespace a request's blocks live in on a worker: its LoRA adapter's name (/generate's
    `lora_path`), None for the base model."""
    lora = body.get("lora_path") if route == "/generate" else None
    return lora if isinstance(lora, str) and lora else None



class RouterTokenizer:
    """The kv_aware router's tokenizer, loaded off the event loop once its path is known: --tokenizer-path or
    --model-path, else the first model_path a worker's /server_info reports. Until it is loaded (or when it
    cannot be), prompts have no tokens and the policies fall back."""

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path or None
        self.prompts: Optional[PromptTokenizer] = None
        self.error: Optional[str] = None
        self._task: Optional[asyncio.Task] = None
        self._told = False

    def start(self) -> None:
        if self.path and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._load(self.path))

    def offer(self, path: Any) -> None:
        """A worker's model_path: used when no path was given, none was offered before, and it exists here (a
        worker shows only its model's name to a router without its API key)."""
        if self.path is not None or not isinstance(path, str) or not path:
            return
        if not os.path.exists(path):
            if not self._told:
                self._told = True
                logger.warning("kv_aware: a worker's model path %r is not a file here; start the router with "
                               "--model-path or --tokenizer-path (until then it routes by the text tree)", path)
            return
        self.path = path
        self.start()

    async def ready(self, timeout_s: float) -> bool:
        if self._task is not None:
            await asyncio.wait([self._task], timeout=timeout_s)
        return self.prompts is not None

    async def _load(self, path: str) -> None:
        try:
            self.prompts = await asyncio.to_thread(PromptTokenizer.load, path)
            logger.info("kv_aware: tokenizing prompts with %s", path)
        except Exception as e:  # noqa: BLE001 - routing goes on by text
            self.error = f"{type(e).__name__}: {e}"
            logger.warning("kv_aware: cannot load the tokenizer of %s (%s); routing by the text tree", path,
                           self.error)

    async def tokens(self, route: str, body: dict) -> Optional[PromptTokens]:
        return await self.prompts.tokens(route, body) if self.prompts is not None else None

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
