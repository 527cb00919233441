"""KV-aware routing (issue 66, part 2): the router follows each worker's KV events into an exact block index and
sends a prompt where the fewest tokens are left to prefill, weighed against the worker's queue; it falls back
to the text tree while a view is out of sync or a prompt has no tokens. End to end: `tidal cluster --policy
kv_aware` (servers publish on free ports, the router learns them from /server_info) sends prompts that share a
prefix to the worker that holds it, and the hits it expected are the hits the workers report."""

from __future__ import annotations

import asyncio
import sys
import time

import httpx
import pytest

from servers import Server, free_port, free_port_block
from tidal.kvevents.events import BlockStored, KVEventsConfig, block_hashes
from tidal.kvevents.publisher import KVEventPublisher
from tidal.router.kv_aware import KVAwarePolicy, KVEventsFollower, PromptTokenizer, subscriber_endpoint
from tidal.router.policies import CacheAwarePolicy, PromptTokens
from tidal.router.workers import NULL, Worker

pytestmark = pytest.mark.timeout(300)


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


class FakeFollower(KVEventsFollower):
    """An index filled by hand, every view in sync unless told otherwise."""

    def __init__(self, block_size: int = 4) -> None:
        super().__init__()
        self.unsynced: set[str] = set()
        self.size = block_size

    def hold(self, url: str, tokens: list[int]) -> None:
        self.block_sizes[url] = self.size
        self.index.set_synced(url, True)
        from tidal.kvevents.events import KVEventBatch
        self.index.apply(url, KVEventBatch(0.0, [BlockStored(block_hashes(tokens, self.size), None, tokens,
                                                            self.size)]))

    def synced(self, url: str) -> bool:
        return url in self.block_sizes and url not in self.unsynced


def workers(*loads: int) -> list[Worker]:
    return [Worker(url=f"http://w{i}:1", mode=NULL, healthy=True, in_flight=n) for i, n in enumerate(loads)]


def test_the_worker_holding_the_longest_prefix_wins_unless_its_queue_costs_more():
    f = FakeFollower()
    pool = workers(0, 0, 0)
    prefix = list(range(100, 164))  # 16 blocks
    for w in pool:
        f.hold(w.url, [])
    f.hold(pool[1].url, prefix[:32])
    f.hold(pool[2].url, prefix)
    policy = KVAwarePolicy(f, CacheAwarePolicy(), load_weight=1.0)
    prompt = PromptTokens(prefix + [1, 2, 3, 4])
    assert policy.select(pool, "t", prompt) is pool[2]
    assert policy.cached_tokens == 64 and policy.fallbacks == 0
    # two open requests of ~68 tokens each on w2 outweigh its 32 extra cached tokens: w1 wins
    pool[2].in_flight = 2
    assert policy.select(pool, "t", prompt) is pool[1]
    # weight 0: cache hits only
    assert KVAwarePolicy(f, CacheAwarePolicy(), load_weight=0.0).select(pool, "t", prompt) is pool[2]


def test_ties_go_to_the_less_loaded_then_the_emptier_worker_and_namespaces_do_not_match():
    f = FakeFollower()
    pool = workers(1, 0, 0)
    f.hold(pool[0].url, [])
    f.hold(pool[1].url, list(range(40)))
    f.hold(pool[2].url, [])
    policy = KVAwarePolicy(f, CacheAwarePolicy(), load_weight=0.0)
    fresh = PromptTokens(list(range(500, 520)))
    assert policy.select(pool, "", fresh) is pool[2]  # w0 is busier, w1 holds more blocks
    # the same tokens under a LoRA adapter are another prefix: no worker holds them
    assert policy.select(pool, "", PromptTokens(list(range(40)), namespace="adapter")) is pool[2]
    assert policy.select(pool, "", PromptTokens(list(range(40)))) is pool[1]


def test_no_tokens_or_a_view_out_of_sync_falls_back_to_the_text_tree_which_it_keeps_warm():
    f = FakeFollower()
    pool = workers(0, 0)
    for w in pool:
        f.hold(w.url, [])
    f.hold(pool[1].url, list(range(64)))
    fallback = CacheAwarePolicy()
    policy = KVAwarePolicy(f, fallback)
    text = "a long shared system prompt " * 4
    assert policy.select(pool, text, PromptTokens(list(range(64)))) is pool[1]
    f.unsynced.add(pool[0].url)
    assert policy.select(pool, text, PromptTokens(list(range(64)))) is pool[1]  # the tree learned it above
    assert policy.select(pool, text, None) is pool[1]
    assert policy.fallbacks == 2 and policy.routed == 1
    assert KVAwarePolicy(None, CacheAwarePolicy()).select(pool, text, PromptTokens([1])) in pool


def test_a_wildcard_bind_is_reached_at_the_workers_host():
    assert subscriber_endpoint("tcp://0.0.0.0:5557", "10.0.0.2") == "tcp://10.0.0.2:5557"
    assert subscriber_endpoint("tcp://*:5557", "::1") == "tcp://[::1]:5557"
    assert subscriber_endpoint("tcp://10.0.0.3:5557", "10.0.0.2") == "tcp://10.0.0.3:5557"
    assert subscriber_endpoint("ipc:///tmp/kv", "10.0.0.2") == "ipc:///tmp/kv"


class CharTokenizer:
    chat_template = "x"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def apply_chat_template(self, msgs, tools=None, tokenize=False, add_generation_prompt=True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in msgs) + "<assistant>"


def test_prompts_are_tokenized_as_the_workers_do():
    asyncio.run(_tokenized_as_the_workers_do())


async def _tokenized_as_the_workers_do():
    tok = PromptTokenizer(CharTokenizer())
    assert (await tok.tokens("/generate", {"text": "ab"})).ids == [1, 97, 98]
    assert (await tok.tokens("/generate", {"input_ids": [5, 6], "lora_path": "a"})) == PromptTokens([5, 6], "a")
    assert await tok.tokens("/generate", {"text": ["a", "b"]}) is None  # a batch: no single prompt
    assert (await tok.tokens("/v1/completions", {"prompt": ["ab"]})).ids == [1, 97, 98]
    chat = await tok.tokens("/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert chat.ids == [ord(c) for c in "<user>hi<assistant>"]  # templated, no special tokens added
    assert await tok.tokens("/v1/chat/completions", {"messages": "nope"}) is None


def test_the_follower_syncs_an_idle_worker_at_once_and_starts_over_when_it_restarts():
    ep, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(KVEventsConfig(publisher="zmq", endpoint=ep, replay_endpoint=rep))
    follower = KVEventsFollower()
    w = Worker(url="http://127.0.0.1:1", mode=NULL, healthy=True)
    info = {"boot_id": "a", "kv_events": {"endpoint": ep, "replay_endpoint": rep, "topic": "", "block_size": 4}}
    try:
        follower.learn(w, info)
        assert wait_until(lambda: follower.synced(w.url))  # from a snapshot: the idle worker published nothing
        tokens = list(range(8))
        pub.publish([BlockStored(block_hashes(tokens, 4), None, tokens, 4)])
        assert wait_until(lambda: follower.index.size(w.url) == 2)
        sub = follower._subs[w.url]
        follower.learn(w, info)  # the same worker, the same boot: nothing changes
        assert follower._subs[w.url] is sub
        follower.learn(w, {**info, "boot_id": "b"})  # restarted: a fresh view
        assert follower._subs[w.url] is not sub
        assert wait_until(lambda: follower.synced(w.url))
        follower.learn(w, {"boot_id": "b"})  # no events any more: forgotten
        assert not follower.synced(w.url) and follower.state(w.url) is None
    finally:
        follower.close()
        pub.close()


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def kv_cluster():
    port, base = free_port(), free_port_block(2)
    cmd = [sys.executable, "-m", "tidal.cli", "cluster", "--prefill", "0", "--decode", "0", "--worker", "2",
           "--policy", "kv_aware", "--port", str(port), "--base-port", str(base), "--torch-threads", "1",
           "--server-args", "--max-total-tokens 8192 --dtype float32 --page-size 16"]
    router = Server(cmd=cmd, port=port)
    yield router
    router.stop()


def test_cluster_routes_shared_prefixes_to_the_worker_that_holds_them(kv_cluster):
    url = kv_cluster.url
    assert wait_until(lambda: all(w.get("kv_events", {}) and w["kv_events"]["synced"]
                                  for w in httpx.get(url + "/workers", timeout=10).json()["workers"]), 60)
    assert httpx.get(url + "/workers", timeout=10).json()["tokenizer"]["loaded"]  # before the router was ready
    systems = ["You are a helpful assistant who answers questions about Roman history in great detail. " * 3,
               "You are a terse code reviewer who only ever answers with short Python snippets, no prose. " * 3]
    cached = 0
    for i in range(3):
        for s in systems:
            r = httpx.post(url + "/generate", json={"text": f"{s}Question {i}?", "sampling_params": {
                "max_new_tokens": 2, "temperature": 0}}, timeout=120)
            assert r.status_code == 200, r.text
            meta = r.json()["meta_info"]
            if i:  # the first of each prefix warms a worker; every later one lands there
                assert meta["cached_tokens"] >= meta["prompt_tokens"] - 32, (i, meta)
            cached += meta["cached_tokens"]
    chat = {"model": "default", "messages": [{"role": "system", "content": systems[0]},
                                             {"role": "user", "content": "hi"}], "max_tokens": 2}
    first = httpx.post(url + "/v1/chat/completions", json=chat, timeout=120).json()["usage"]
    again = httpx.post(url + "/v1/chat/completions", json=chat, timeout=120).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] - 16
    cached += first["prompt_tokens_details"]["cached_tokens"] + again["prompt_tokens_details"]["cached_tokens"]
    body = httpx.get(url + "/workers", timeout=10).json()
    stats = body["policies"]["null"]
    assert stats["fallbacks"] == 0 and stats["routed"] == 8
    assert stats["expected_cached_tokens"] == cached  # the router's index agreed with every worker's cache
    assert all(w["kv_events"]["blocks"] > 0 for w in body["workers"])  # the two prefixes went apart


def test_a_burst_sharing_a_prefix_follows_the_first_pick_before_its_blocks_are_stored():
    f = FakeFollower()
    pool = workers(0, 0)
    for w in pool:
        f.hold(w.url, [])
    policy = KVAwarePolicy(f, CacheAwarePolicy(), load_weight=0.25)
    prefix = list(range(1000, 1064))
    first = policy.select(pool, "", PromptTokens(prefix + [1]))
    first.in_flight = 1  # still prefilling: no event yet
    assert policy.select(pool, "", PromptTokens(prefix + [2])) is first
    policy.predicted[first.url] = {h: 0.0 for h in policy.predicted[first.url]}  # the prediction expired
    assert policy.select(pool, "", PromptTokens(prefix + [3])) is not first
