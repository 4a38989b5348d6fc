"""kvgate's approximate prefix-cache index (``ext_proc/prefix.py``) and prefix affinity in node choice."""

from __future__ import annotations

from ext_proc.prefix import PrefixIndex, chain_of, segment_chain, text_chain, text_of
from tests.test_nodes import feed, fleet

A, B = "10.0.0.0:8000", "10.0.0.1:8000"


def test_a_chain_covers_everything_before_each_full_block() -> None:
    system = "You are a helpful assistant. " * 40  # 1,160 characters: 4 full blocks of 256
    one = text_chain(system + "What is KV caching?", 256, 100)
    two = text_chain(system + "Tell me about prefix reuse in vLLM.", 256, 100)
    assert len(one) == len(two) == 4 and one == two, "the shared text gives the same blocks; partial blocks none"
    other = text_chain("x" + system, 256, 100)
    assert not set(other) & set(one), "a block's key covers all before it: a shifted text shares nothing"
    assert len(text_chain(system * 10, 256, 8)) == 8, "at most max_blocks"
    assert text_chain("short", 256, 8) == ()


def test_the_text_of_a_chat_is_its_roles_and_contents_in_order() -> None:
    doc = {"messages": [{"role": "system", "content": "S"},
                        {"role": "user", "content": [{"type": "text", "text": "U"},
                                                     {"type": "image_url", "image_url": {"url": "http://i/1.png"}}]}]}
    assert text_of(doc) == "\x00system\x01S\x00user\x01U\x02image_url:http://i/1.png\x03", \
        "an image is part of the key (another image: another cache entry)"
    assert text_of({"prompt": "P"}) == "P" and text_of({"prompt": [1, 2]}) == "1,2" and text_of(None) == ""


def test_the_model_and_the_cache_salt_key_the_chain_as_they_key_vllms_cache() -> None:
    body = {"messages": [{"role": "system", "content": "A long shared instruction. " * 100}]}
    base = chain_of({**body, "model": "llama"}, 512, 128)
    assert base and base == chain_of({**body, "model": "llama"}, 512, 128)
    assert not set(base) & set(chain_of({**body, "model": "llama-lora-a"}, 512, 128)), "another adapter"
    assert not set(base) & set(chain_of({**body, "model": "llama", "cache_salt": "t1"}, 512, 128)), "a salt"


def test_segments_share_blocks_while_they_share_leading_segments() -> None:
    a = segment_chain([("sys", 1500), ("doc-1", 3000)], 1000, 64)
    b = segment_chain([("sys", 1500), ("doc-1", 3000), ("q", 100)], 1000, 64)
    c = segment_chain([("sys", 1500), ("doc-2", 3000)], 1000, 64)
    assert len(a) == 4500 // 64 and b[:len(a)] == a
    shared = 1500 // 64  # the block that straddles sys and the document differs
    assert c[:shared] == a[:shared] and c[shared] != a[shared]


def test_the_index_matches_the_longest_leading_run_per_node_and_forgets() -> None:
    idx = PrefixIndex(max_blocks_per_node=5, ttl_s=100.0)
    idx.record("a", (1, 2, 3, 4), now=0.0)
    idx.record("b", (1, 2, 9), now=0.0)
    assert idx.match((1, 2, 3, 4, 5), now=1.0) == {"a": 4, "b": 2}
    assert idx.match((7, 1, 2), now=1.0) == {}, "leading blocks only"
    idx.record("a", (1, 2, 30, 40), now=2.0)  # 6 distinct blocks on a: its least recently used goes —
    # the old chain's tail (recorded tail first, as vLLM frees a request's blocks)
    assert idx.match((1, 2, 3, 4), now=3.0)["a"] == 3 and idx.match((1, 2, 30, 40), now=3.0)["a"] == 4
    assert len(idx) == 5 + 3
    assert idx.match((1, 2), now=150.0) == {}, "expired"
    idx.forget("a")
    assert "a" not in idx.match((1, 2, 9), now=3.0) and idx.match((1, 2, 9), now=3.0) == {"b": 3}


def test_a_request_goes_where_its_prefix_is_unless_another_node_is_sooner_by_more_than_it_saves() -> None:
    f = fleet(2)
    feed(f, 0.0, 0.1, 0.1)
    chain = text_chain("A long shared document. " * 400, 512, 128)  # 9,600 characters: 18 blocks of 512
    prompt = 2600
    first = f.place(prompt + 100, prompt, "t1", 0.0, prefix=chain)
    assert first.node is not None and first.hit == 0
    home = first.node.address
    f.completed(home, "t1", prompt + 100, True, 0.5)
    feed(f, 1.0, 0.1, 0.1)
    again = f.place(prompt + 100, prompt, "t2", 1.0, prefix=chain)
    assert again.node is not None and again.node.address == home, "the node holding the prefix computes less"
    assert again.hit == 18 * 128
    f.completed(home, "t2", prompt + 100, True, 1.5)
    # the home node gets a long backlog of urgent prefill: now the other node is sooner despite the prefix
    for i in range(6):
        f.dispatched(home, f"x{i}", 8000, 8000, 2.0, priority=0)
    moved = f.place(prompt + 100, prompt, "t3", 2.0, prefix=chain)
    assert moved.node is not None and moved.node.address != home and moved.hit == 0
    assert f.hits(chain, prompt, 2.0) == {home: 18 * 128, moved.node.address: 18 * 128}, "both hold it now"


def test_prefix_affinity_off_changes_nothing() -> None:
    f = fleet(2, prefix={"enabled": False})
    feed(f, 0.0, 0.1, 0.1)
    chain = text_chain("A long shared document. " * 400, 512, 128)
    assert f.place(3000, 2600, "t1", 0.0, prefix=chain).hit == 0
    assert f.hits(chain, 2600, 0.0) == {} and len(f.prefix) == 0


def test_each_nodes_prefix_hit_rate_is_exported() -> None:
    import time

    from prometheus_client import generate_latest

    from ext_proc.config import parse_config
    from ext_proc.core import Core
    from gpu_probe.snapshot import Snapshot

    cfg = parse_config({"nodes": {"static": [{"address": A, "probe": "http://p0"}, {"address": B, "probe": "http://p1"}]}})
    core = Core(cfg, time.monotonic)
    core.snapshot(A, Snapshot(node="n", at=time.time(), ok=True, kv_usage=0.2, blocks_total=100, block_size=16,
                              prefix_hit_rate=0.75))
    core.snapshot(B, Snapshot(node="n", at=time.time(), ok=True, kv_usage=0.2, blocks_total=100, block_size=16))
    text = generate_latest(core.stats.registry).decode()
    assert f'kvgate_node_prefix_cache_hit_ratio{{node="{A}",pool="default"}} 0.75' in text
    assert f'kvgate_node_prefix_cache_hit_ratio{{node="{B}"}}' not in text, "no queries: no ratio"


def test_what_a_node_holds_stays_one_run_from_the_start_when_a_chain_grows_and_ages() -> None:
    idx = PrefixIndex(max_blocks_per_node=15, ttl_s=600.0)
    turn1 = tuple(range(1, 11))
    turn2 = (*turn1, *range(11, 16))  # the next turn of the same conversation: the history grows
    idx.record("a", turn1, now=0.0)
    idx.record("a", turn2, now=50.0)
    idx.record("a", (99,), now=60.0)  # one block too many: the least recently used goes — the tail
    assert idx.match(turn2, now=61.0) == {"a": 14}
    assert idx.match(turn2, now=655.0) == {}, "the whole run ages together (the head was refreshed with it)"
