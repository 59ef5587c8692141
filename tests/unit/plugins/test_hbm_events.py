"""HBM as vLLM holds it (issue 32, item 5): ``HbmCache`` follows vLLM's own KV cache events.

The events go through vLLM's real publisher (``ZmqEventPublisher``, msgpack over a ZMQ PUB socket
on an ``inproc://`` endpoint, as ``kvtier serve`` sets it up) to the cache's real subscriber thread;
each test waits on the batches applied, never on time.
"""
from __future__ import annotations

import itertools

import pytest
from support.realpath import need

need("vllm")

from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from kvtier.plugins.vllm.hbm import HbmCache, events_endpoint, subscribe_endpoint  # noqa: E402
from kvtier.plugins.vllm.state import anonymous_session, valid_session  # noqa: E402

_ids = itertools.count()


def stored(hashes, parent=None, session=None) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[0] * 16 * len(hashes),
                       block_size=16, lora_id=None, medium="GPU", lora_name=None, session_id=session)


def removed(hashes) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


@pytest.fixture
def wired():
    """vLLM's publisher and kvtier's subscriber on one inproc endpoint."""
    endpoint = f"inproc://kvtier-test-{next(_ids)}"
    cache = HbmCache(valid_session)
    cache.listen(endpoint, "kv")
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, topic="kv")

    def send(*events) -> None:
        before = cache.batches
        publisher.publish(KVEventBatch(ts=0.0, events=list(events)))
        assert cache.wait_for(lambda: cache.batches > before, 10.0), "the batch never arrived"

    # a subscriber joins a PUB socket asynchronously: publish an empty batch until one arrives
    for _ in range(200):
        publisher.publish(KVEventBatch(ts=0.0, events=[]))
        if cache.wait_for(lambda: cache.batches > 0, 0.05):
            break
    assert cache.batches > 0, "the subscriber never joined"
    yield cache, send
    publisher.shutdown()
    cache.close()


def test_stored_and_removed_blocks_follow_their_sessions(wired):
    cache, send = wired
    send(stored([b"a1", b"a2", b"a3"], session="agent-1"), stored([b"b1"], session="agent-2"))
    assert cache.held_blocks() == 4
    assert cache.sessions() == {"agent-1": 3, "agent-2": 1}
    send(removed([b"a3", b"b1", b"never-stored"]))
    assert cache.sessions() == {"agent-1": 2}
    assert cache.held_blocks() == 2 and cache.session_blocks("agent-2") == 0


def test_a_reused_prefix_counts_once_for_the_session_that_reused_it(wired):
    cache, send = wired
    send(stored([b"sys", b"x1"], session="first"))
    send(stored([b"sys"], session="second"))  # vLLM reports prefix-cache hits as stores too
    assert cache.sessions() == {"first": 1, "second": 1} and cache.held_blocks() == 2


def test_requests_without_a_session_id_are_named_as_the_scheduler_names_them(wired):
    cache, send = wired
    first = b"\x01" * 32
    send(stored([first, b"c2"]), stored([b"c3"], parent=b"c2"))  # the chain continues in a later event
    assert cache.sessions() == {anonymous_session(first): 3}
    send(stored([b"\x02" * 32], session="bad id with spaces"))  # an id kvtier refuses: anonymous, as requests
    assert cache.session_blocks(anonymous_session(b"\x02" * 32)) == 1


def test_a_prefix_cache_reset_clears_everything(wired):
    cache, send = wired
    send(stored([b"a", b"b"], session="s"))
    send(AllBlocksCleared())
    assert cache.held_blocks() == 0 and cache.sessions() == {}


def test_endpoints_follow_vllms_config():
    from vllm.config import KVEventsConfig

    class Config:
        kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5557")

        class parallel_config:
            data_parallel_index = 2

    assert events_endpoint(Config) == "tcp://*:5559"  # the publisher's own offset by data-parallel rank
    assert subscribe_endpoint("tcp://*:5559") == "tcp://127.0.0.1:5559"
    assert subscribe_endpoint("inproc://x") == "inproc://x"
    Config.kv_events_config = KVEventsConfig(enable_kv_cache_events=False)
    assert events_endpoint(Config) is None
