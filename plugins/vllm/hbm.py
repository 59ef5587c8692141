"""What vLLM holds in HBM, as vLLM's own KV cache events tell it.

The block tables of running requests show only part of HBM: once a turn finishes, vLLM frees its
blocks but keeps them in its prefix cache, and that cache is where a session's next turn hits
first. vLLM publishes every block it caches and every block it evicts (``--kv-events-config``,
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``) on a ZMQ PUB socket from the engine-core
process, the process the connector's scheduler half runs in. ``HbmCache`` subscribes to that socket
from a thread of its own and keeps:

* the hashes vLLM holds, each with the session that last stored or reused it (a prefix shared by
  several sessions counts once, for the last one: the shares add up to what is held);
* per session, how many of its blocks are held: a session with any is ``hot`` (its next turn hits
  vLLM's own cache), and ``sessions`` / ``inspect`` / ``top`` show its HBM share.

``kvtier serve`` turns the events on with an ``inproc://`` endpoint (no port, no file: the PUB and
SUB sockets share vLLM's process-wide ZMQ context). A hand-written vLLM command line with
``--kv-events-config`` on a ``tcp://`` or ``ipc://`` endpoint works too (kvtier connects to it
beside the user's own consumers); without events, HBM shows running requests only and says so.

A session's blocks are named the way the scheduler half names them: the event's ``session_id`` (the
request's), else ``anon-<first block hash>`` following the chain of parent hashes, as
``session_of`` does. With ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` the hashes are 64-bit ints: the
totals still hold, and only events that carry a session id are attributed.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Callable

from kvtier.plugins.vllm.state import anonymous_session

__all__ = ["HbmCache", "events_endpoint", "hbm_usage", "subscribe_endpoint"]

log = logging.getLogger("kvtier.connector")



def events_endpoint(vllm_config: Any) -> str | None:
    """The endpoint vLLM publishes its KV cache events on (None: events off or not published)."""
    config = getattr(vllm_config, "kv_events_config", None)
    if config is None or not getattr(config, "enable_kv_cache_events", False) or config.publisher != "zmq":
        return None
    endpoint = config.endpoint
    dp_rank = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_index", 0) or 0
    if dp_rank:  # the publisher offsets its endpoint by the data-parallel rank: follow it
        from kvtier.plugins.vllm.compat import ZmqEventPublisher

        endpoint = ZmqEventPublisher.offset_endpoint_port(endpoint, dp_rank)
    return endpoint


def subscribe_endpoint(endpoint: str) -> str:
    """Where a subscriber connects for a publisher bound at ``endpoint`` (``tcp://*:5557`` binds every
    interface; this process reaches it on the loopback)."""
    for wildcard in ("*", "0.0.0.0", "[::]"):
        if endpoint.startswith(f"tcp://{wildcard}:"):
            return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]
    return endpoint


def hbm_usage(cache: "HbmCache | None", running: int, capacity: int | None, block_bytes: int) -> dict:
    """vLLM's KV cache in HBM: its capacity; the ``running`` blocks running requests hold (their
    block tables); and, where ``cache`` follows vLLM's events, the blocks its prefix cache holds
    besides them (freed, reusable by the next turn that shares their prefix, reclaimed first-come
    when vLLM needs room). Occupied = running + cached-only."""
    cached = reclaimable = None
    if cache is not None and cache.listening:
        cached = cache.held_blocks()
        # every full block a running request holds is in the prefix cache too (its partial last
        # block is not): the rest of the cache is held by nothing but the cache
        reclaimable = max(0, cached - running)
    occupied = running + (reclaimable or 0)
    return {"used_bytes": occupied * block_bytes, "blocks": occupied,
            "running_blocks": running, "running_bytes": running * block_bytes,
            "cached_blocks": cached, "reclaimable_blocks": reclaimable,
            "reclaimable_bytes": reclaimable * block_bytes if reclaimable is not None else None,
            "source": "kv_events" if cached is not None else "block_tables",
            "capacity_bytes": capacity * block_bytes if capacity else None}


class HbmCache:
    """The blocks vLLM's prefix cache holds, and each session's share (thread-safe; see module doc)."""

    def __init__(self, valid_session: Callable[[str], bool] = lambda s: True):
        self._valid = valid_session
        self._lock = threading.RLock()  # wait_for's predicate may call the readers below
        self._owner: dict[Any, str | None] = {}  # held hash -> the session that last stored or reused it
        self._per_session: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.endpoint: str | None = None
        self.batches = 0  # event batches applied: tests wait on this
        self.applied = threading.Condition(self._lock)

    # ---- the events ---------------------------------------------------------------------------
    def apply(self, events: list[Any]) -> None:
        """Apply one batch of vLLM KV cache events (``BlockStored``, ``BlockRemoved``,
        ``AllBlocksCleared``; any other kind, or another KV cache group's, is ignored)."""
        with self._lock:
            for event in events:
                kind = type(event).__name__
                if getattr(event, "group_idx", None) not in (None, 0):
                    continue  # kvtier serves one full-attention group
                if kind == "BlockStored":
                    self._stored(event)
                elif kind == "BlockRemoved":
                    for block_hash in event.block_hashes:
                        self._drop(block_hash)
                elif kind == "AllBlocksCleared":
                    self._owner.clear()
                    self._per_session.clear()
            self.batches += 1
            self.applied.notify_all()

    def _stored(self, event: Any) -> None:
        session = event.session_id if event.session_id and self._valid(str(event.session_id)) else None
        session = str(session) if session is not None else None
        parent = event.parent_block_hash
        for block_hash in event.block_hashes:
            owner = session
            if owner is None:  # the scheduler half's name for a request without a session id
                if parent is None and isinstance(block_hash, bytes):
                    owner = anonymous_session(block_hash)
                else:
                    owner = self._owner.get(parent)
            self._drop(block_hash)
            self._owner[block_hash] = owner
            if owner is not None:
                self._per_session[owner] += 1
            parent = block_hash

    def _drop(self, block_hash: Any) -> None:
        if block_hash not in self._owner:
            return
        owner = self._owner.pop(block_hash)
        if owner is not None:
            left = self._per_session[owner] - 1
            if left > 0:
                self._per_session[owner] = left
            else:
                del self._per_session[owner]

    # ---- what the admin plane reads -------------------------------------------------------------
    @property
    def listening(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def held_blocks(self) -> int:
        with self._lock:
            return len(self._owner)

    def session_blocks(self, session_id: str) -> int:
        with self._lock:
            return self._per_session.get(session_id, 0)

    def sessions(self) -> dict[str, int]:
        """Every session with blocks in vLLM's prefix cache, and how many (a copy)."""
        with self._lock:
            return dict(self._per_session)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate`` (called under the cache's lock) holds after a batch (tests)."""
        with self._lock:
            return self.applied.wait_for(predicate, timeout)

    # ---- the subscriber -------------------------------------------------------------------------
    def listen(self, endpoint: str, topic: str = "") -> None:
        """Subscribe to vLLM's publisher at ``endpoint`` from a daemon thread. Connecting first is
        fine for every transport (an inproc endpoint may be bound after; ZMQ reconnects on tcp)."""
        import zmq

        socket = zmq.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        socket.setsockopt(zmq.RCVTIMEO, 200)  # wake to see the stop flag
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(subscribe_endpoint(endpoint))
        self.endpoint = endpoint
        self._thread = threading.Thread(target=self._run, args=(socket,), name="kvtier-hbm-events", daemon=True)
        self._thread.start()

    def _run(self, socket: Any) -> None:
        import msgspec
        import zmq

        from kvtier.plugins.vllm.compat import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        try:
            while not self._stop.is_set():
                try:
                    parts = socket.recv_multipart()
                except zmq.Again:
                    continue
                try:
                    self.apply(decoder.decode(parts[-1]).events)
                except Exception:  # noqa: BLE001 - a batch kvtier cannot read must not stop the others
                    log.exception("kvtier: could not apply a KV cache event batch")
        except zmq.ZMQError as exc:  # the context was terminated: vLLM is shutting down
            log.debug("kvtier: KV event subscriber stopped: %s", exc)
        finally:
            socket.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
