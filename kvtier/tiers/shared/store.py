"""The shared tier: KV blocks in a Valkey/Redis store that several boxes reach.

A box's DRAM and NVMe tiers are its own; this one is the store every box behind a router can
read, so an agent's next turn that lands on another box loads its prefix instead of recomputing
it. It is an existing distributed store (standalone, Sentinel-less primary, or a cluster), not a
home-made one, and it is treated as a cache that may forget anything at any time: the store's own
eviction and a TTL on every key are expected, and a missing key is a miss, never an error.

Same interface as the NVMe tier (``kvtier.tiers.base.BlockStore``): ``write_batch`` /
``read_batch`` / ``delete_many`` of ``(namespace, key)`` blocks, one pipeline per batch.

Keys and values::

    kvt1:b:<namespace hex>:<block key hex>:<rank>   one rank's shard of one block (TTL)
        [176-byte record header][16-byte HMAC of the header][payload]
    kvt1:s:<fingerprint hex>:<session id>           a session's entry: ordered keys, token ids, pin (TTL)
    kvt1:sessions:<fingerprint hex>                 sorted set: session id -> last published (TTL)

The header is the NVMe record's (``kvtier.tiers.records``: magic, version, fingerprint, namespace,
key, rank, codec, payload length and xxh3, its own xxh3), so a value is verified alone: a value
under the wrong key, of another model, rank or tenant, truncated or damaged is refused and never
served. Checksums prove a value intact, not who wrote it -- anyone who can write to the store can
write valid checksums -- so the header is also signed with the box's snapshot key
(``kvtier.persist.trust``; boxes that share a store share that keys file), and a value no trusted key
signed is refused too.

Faults never reach a request: every call has a short socket timeout and no client-side retries,
and after a failure (down, paused, full, wrong credentials) the store is skipped for a back-off
(0.5 s doubling to 8 s) during which every call answers at once -- reads as misses, writes as
skipped. The first call after the back-off is the probe; ``state`` and ``problem`` say what is
wrong for ``status`` and ``kvtier top``. Nothing here runs on vLLM's step path: the worker's
mover threads and publisher, and the scheduler half's lookup thread, make these calls.

Credentials never come from the command line: a password in the URL is refused; they come from a
file (``--shared-auth-file``) or ``KVTIER_SHARED_USERNAME`` / ``KVTIER_SHARED_PASSWORD``.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

from kvtier.errors import ConfigError, CorruptBlockError, SharedUnavailable, StorageError
from kvtier.tiers.shared.config import SHARED_POLICIES, SharedConfig, display_url, load_credentials, parse_shared_url  # noqa: F401 - re-exported
from kvtier.tiers.shared.keys import block_key
from kvtier.tiers.shared.resp import ZeroCopyPacker, copy_into, get_into, packed_connection, pipeline_get
from kvtier.tiers.shared.sessions import SessionEntries

__all__ = ["SharedConfig", "SharedStore", "SharedUnavailable", "block_key", "parse_shared_url",
           "load_credentials", "SHARED_POLICIES", "VALUE_PREFIX"]

log = logging.getLogger(__name__)

_HEADER_BYTES = 176  # records._HEADER.size + its 8-byte checksum
_MAC_BYTES = 16
VALUE_PREFIX = _HEADER_BYTES + _MAC_BYTES
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 8.0


class ForeignValue(CorruptBlockError):
    """A value in the shared store that is not a block this box may serve."""


# ---- the store -----------------------------------------------------------------------------------
class SharedStore(SessionEntries):
    """One box's (one rank's) client of the shared store. Thread-safe."""

    name = "shared"

    def __init__(self, config: SharedConfig, rank: int = 0, env: Mapping[str, str] | None = None):
        self.config = config
        self.rank = rank
        self.url = display_url(config.url)
        self.username, self.password = load_credentials(config.auth_file, env)
        self.counters: Counter[str] = Counter()
        self.state = "unknown"  # ok | down | unknown (never reached yet)
        self.problem: str | None = None  # why it is down, for status
        self.cluster = False
        self._client = None
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._backoff = 0.0
        self._keys: list[bytes] | None = None  # trusted keys (kvtier.persist.trust), loaded on first use
        self._keys_at = 0.0
        self._sign: bytes | None = None
        self.rtt_s: float | None = None
        self.read_bps: float | None = None

    # ---- connection and health ----------------------------------------------------------------
    def _connect(self):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        timeout = self.config.timeout_s
        common = dict(username=self.username, password=self.password, socket_timeout=timeout,
                      socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0), health_check_interval=0,
                      socket_read_size=1 << 20,  # blocks are large: fewer, larger recv()s
                      protocol=2)  # RESP2: what _get_into parses (redis-py 8 asks for RESP3 by default)
        if self.config.url.startswith("rediss://") and self.config.ca_file:
            common["ssl_ca_certs"] = self.config.ca_file
        # values go out as (header, payload) without being joined or copied (ZeroCopyPacker)
        client = redis.Redis(connection_pool=redis.ConnectionPool.from_url(
            self.config.url, command_packer=ZeroCopyPacker(), **common))
        if not self.config.url.startswith("unix://"):
            try:
                enabled = str(client.info("cluster").get("cluster_enabled", 0)) == "1"
            except redis.ResponseError:  # a server without the cluster section
                enabled = False
            if enabled:
                from redis.cluster import RedisCluster

                client.close()
                client = RedisCluster.from_url(self.config.url,
                                               connection_class=packed_connection(self.config.url), **common)
                self.cluster = True
        return client

    def _call(self, fn):
        """Run ``fn(client)``; any failure opens the back-off. Raises ``SharedUnavailable`` at once
        while the back-off lasts, so nobody waits on a store known to be down."""
        import redis

        now = time.monotonic()
        if now < self._retry_at:
            self.counters["skipped_down"] += 1
            raise SharedUnavailable(f"shared store {self.url} is {self.problem or 'down'}")
        try:
            with self._lock:
                client = self._client
            if client is None:
                client = self._connect()
                with self._lock:
                    self._client = client
            result = fn(client)
        except (redis.RedisError, OSError, ValueError) as exc:
            self._failed(exc)
            raise SharedUnavailable(f"shared store {self.url}: {self.problem}") from None
        if self.state != "ok":
            if self.state == "down":
                log.warning("kvtier: shared store %s is back", self.url)
                self.counters["recoveries"] += 1
            self.state, self.problem, self._backoff = "ok", None, 0.0
        return result

    def _failed(self, exc: BaseException) -> None:
        import redis

        if isinstance(exc, redis.AuthenticationError) or "WRONGPASS" in str(exc) or "NOAUTH" in str(exc):
            problem = "refusing our credentials (check --shared-auth-file / KVTIER_SHARED_PASSWORD)"
        elif isinstance(exc, redis.TimeoutError) or "timed out" in str(exc).lower():
            problem = f"not answering within {self.config.timeout_s:g} s"
        elif type(exc).__name__ == "OutOfMemoryError" or str(exc).startswith(("OOM",
                                                                              "command not allowed when used memory")):
            problem = "full (maxmemory reached and its policy evicts nothing)"
        elif isinstance(exc, (redis.ConnectionError, OSError)):
            problem = f"unreachable ({str(exc).splitlines()[0][:120]})"
        else:
            problem = f"failing ({type(exc).__name__}: {str(exc)[:120]})"
        self._backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, 2 * self._backoff))
        self._retry_at = time.monotonic() + self._backoff
        if self.state != "down" or problem != self.problem:
            log.warning("kvtier: shared store %s is %s; retrying in %.1f s", self.url, problem, self._backoff)
        self.state, self.problem = "down", problem
        self.counters["errors"] += 1
        with self._lock:  # a paused or restarted server: start over with fresh connections
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken client
                pass

    @property
    def available(self) -> bool:
        """Whether a call now would be tried (not inside a back-off)."""
        return time.monotonic() >= self._retry_at

    def ping(self) -> float:
        """One round trip, in seconds (raises ``SharedUnavailable``)."""
        start = time.perf_counter()
        self._call(lambda c: c.ping())
        return time.perf_counter() - start

    # ---- signatures -----------------------------------------------------------------------------
    def _trusted(self, refresh: bool = False) -> list[bytes]:
        from kvtier.persist.trust import load_keys

        now = time.monotonic()
        if self._keys is None or (refresh and now - self._keys_at > 10.0):
            try:
                self._keys = load_keys()
            except ConfigError as exc:
                log.warning("kvtier: shared tier: %s", exc)
                self._keys = []
            self._keys_at = now
        return self._keys

    def _signing_key(self) -> bytes | None:
        if self._sign is None:
            from kvtier.persist.trust import signing_key

            try:
                self._sign = signing_key()
            except (ConfigError, OSError) as exc:
                log.warning("kvtier: shared tier values are written unsigned (other boxes refuse them): %s", exc)
                self._sign = b""
        return self._sign or None

    def _mac(self, data: bytes) -> bytes:
        from kvtier.persist.trust import sign

        key = self._signing_key()
        return sign(key, data) if key else bytes(_MAC_BYTES)

    def _verified(self, data: bytes, mac: bytes) -> bool:
        from kvtier.persist.trust import verify

        return verify(self._trusted(), data, mac) or verify(self._trusted(refresh=True), data, mac)

    # ---- blocks ---------------------------------------------------------------------------------
    def encode_value(self, namespace: bytes, key: bytes, payload, codec: str, fingerprint: bytes) -> bytes:
        """One block as stored: header, its signature, payload (as one bytes object)."""
        return b"".join(self.value_parts(namespace, key, payload, codec, fingerprint))

    def value_parts(self, namespace: bytes, key: bytes, payload, codec: str, fingerprint: bytes) -> tuple:
        """(header and signature, payload view): what ``ZeroCopyPacker`` sends as one value."""
        from kvtier.tiers.records import checksum, pack_header

        data = _as_bytes_view(payload)
        header = bytearray(_HEADER_BYTES)
        pack_header(header, len(data), checksum(data), fingerprint, namespace, codec, key, self.rank)
        return bytes(header) + self._mac(bytes(header)), data

    def decode_value(self, value: bytes | None, namespace: bytes, key: bytes, fingerprint: bytes):
        """The payload (a memoryview) and codec of a stored value, after every check; raises
        ``ForeignValue`` for anything this box may not serve under that key."""
        if value is None:
            raise StorageError(f"shared tier: block {key.hex()[:16]} is not stored")
        payload = memoryview(value)[VALUE_PREFIX:]
        return payload, self._check(value[:VALUE_PREFIX], payload, len(value), namespace, key, fingerprint)

    def _check(self, prefix: bytes, payload, total: int, namespace: bytes, key: bytes, fingerprint: bytes) -> str:
        """Verify a value (its ``prefix``: header and signature; ``payload`` as read) and return its
        codec; ``ForeignValue`` for anything this box may not serve under that key."""
        from kvtier.tiers.records import checksum, unpack_header

        name = key.hex()[:16]
        if total < VALUE_PREFIX:
            raise ForeignValue(f"shared tier: block {name}: value of {total} bytes is too short")
        header = unpack_header(prefix[:_HEADER_BYTES])
        if header is None or header.rank is None:
            raise ForeignValue(f"shared tier: block {name}: not a kvtier block header (or a damaged one)")
        why = ("another model or geometry" if header.fingerprint != fingerprint else
               "another namespace (model revision or tenant)" if header.namespace != namespace else
               "another block's key" if header.key != key else
               f"rank {header.rank}'s shard" if header.rank != self.rank else
               f"a payload of {total - VALUE_PREFIX} bytes, header says {header.nbytes}"
               if header.nbytes != total - VALUE_PREFIX else None)
        if why:
            raise ForeignValue(f"shared tier: block {name}: the value holds {why}")
        if not self._verified(bytes(prefix[:_HEADER_BYTES]), bytes(prefix[_HEADER_BYTES:VALUE_PREFIX])):
            self.counters["rejected_unsigned"] += 1
            raise ForeignValue(f"shared tier: block {name}: not signed by a key this box trusts",
                               hint="boxes that share a store must share the snapshot keys file "
                                    "(kvtier.persist.trust: $KVTIER_SNAPSHOT_KEYS or ~/.config/kvtier/snapshot-keys)")
        if checksum(payload) != header.digest:
            raise ForeignValue(f"shared tier: block {name}: payload checksum mismatch")
        return header.codec

    def write_batch(self, blocks: Sequence[tuple[bytes, bytes, Any, str]],
                    fingerprint: bytes) -> list[BaseException | None]:
        """Put ``(namespace, key, payload, codec)`` blocks, one pipeline, each with the TTL. Returns
        per block None or the exception (all of them when the store is down)."""
        if not blocks:
            return []
        values = [(block_key(ns, key, self.rank), self.value_parts(ns, key, payload, codec, fingerprint))
                  for ns, key, payload, codec in blocks]
        ttl = self.config.ttl_s

        def put(client):
            pipe = client.pipeline(transaction=False)
            for name, value in values:
                pipe.set(name, value, ex=ttl)
            return pipe.execute(raise_on_error=False)

        try:
            replies = self._call(put)
        except SharedUnavailable as exc:
            self.counters["put_skipped"] += len(blocks)
            return [exc] * len(blocks)
        outcomes: list[BaseException | None] = []
        for (_name, value), reply in zip(values, replies):
            if isinstance(reply, Exception):  # e.g. OOM: the store is full and evicts nothing
                self._failed(reply)
                outcomes.append(SharedUnavailable(f"shared store {self.url}: {self.problem}"))
                continue
            outcomes.append(None)
            self.counters["puts"] += 1
            self.counters["put_bytes"] += sum(len(part) for part in value)
        return outcomes

    def read_batch(self, reads: Sequence[tuple[bytes, bytes, Any]], fingerprint: bytes) -> list:
        """Get and verify ``(namespace, key, destination)`` blocks, one pipeline; each payload lands
        in its destination (a uint8 tensor or buffer: read straight into it from the socket on a
        standalone store). Returns per block (nbytes, codec) or the exception: a missing key is a
        ``StorageError`` (a miss), a refused value ``ForeignValue`` (deleted from the store; whatever
        it left in the destination is never reported as a block), everything ``SharedUnavailable``
        when the store is down."""
        if not reads:
            return []
        names = [block_key(ns, key, self.rank) for ns, key, _dst in reads]
        targets = [_as_bytes_view(dst, writable=True) for _ns, _key, dst in reads]
        try:
            got = self._call(lambda client: get_into(client, names, targets, VALUE_PREFIX) if not self.cluster
                             else copy_into(pipeline_get(client, names), targets, VALUE_PREFIX))
        except SharedUnavailable as exc:
            self.counters["get_skipped"] += len(reads)
            return [exc] * len(reads)
        outcomes: list = []
        bad = []
        for (namespace, key, _dst), name, target, item in zip(reads, names, targets, got):
            if item is None:
                self.counters["misses"] += 1
                outcomes.append(StorageError(f"shared tier: block {key.hex()[:16]} is not stored"))
                continue
            prefix, total = item
            if total - VALUE_PREFIX > len(target):
                outcomes.append(StorageError(f"shared tier: block {key.hex()[:16]} holds {total - VALUE_PREFIX} "
                                             f"bytes, more than its {len(target)}-byte destination"))
                continue
            try:
                codec = self._check(prefix, target[: max(total - VALUE_PREFIX, 0)], total, namespace, key, fingerprint)
            except ForeignValue as exc:
                self.counters["rejected"] += 1
                self._warn_rejected(exc)
                bad.append(name)
                outcomes.append(exc)
                continue
            self.counters["hits"] += 1
            self.counters["get_bytes"] += total
            outcomes.append((total - VALUE_PREFIX, codec))
        if bad:  # never served; removed so that the next lookup misses instead of fetching it again
            self.delete_keys(bad)
        return outcomes

    def _warn_rejected(self, exc: BaseException) -> None:
        """Log a refused value, at most once per 10 s (with how many were refused meanwhile)."""
        now = time.monotonic()
        if now - getattr(self, "_rejected_logged", -1e9) >= 10.0:
            quiet = self.counters["rejected"] - getattr(self, "_rejected_seen", 0) - 1
            log.warning("kvtier: %s (refused, never served)%s", exc,
                        f"; {quiet} more refused in the last 10 s" if quiet > 0 else "")
            self._rejected_logged, self._rejected_seen = now, self.counters["rejected"]

    def lengths(self, namespace: bytes, keys: Sequence[bytes], ranks: int = 1) -> list[int]:
        """Payload bytes of each block as stored (the largest rank's), 0 where any rank's shard is
        missing: one pipeline of STRLEN (a lookup; values are verified when read)."""
        if not keys:
            return []
        names = [block_key(namespace, key, rank) for key in keys for rank in range(ranks)]

        def strlen(client):
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.strlen(name)
            return pipe.execute()

        found = self._call(strlen)
        out = []
        for i in range(len(keys)):
            shard = found[i * ranks : (i + 1) * ranks]
            out.append(0 if min(shard) <= VALUE_PREFIX else max(shard) - VALUE_PREFIX)
        self.counters["lookups"] += 1
        return out

    @staticmethod
    def stored_prefix(sizes: Sequence[int]) -> int:
        """How many of ``lengths``' answers, from the first, the store holds (a miss ends a prefix)."""
        return next((i for i, size in enumerate(sizes) if not size), len(sizes))

    def delete_keys(self, names: Sequence[bytes]) -> int:
        try:
            return int(self._call(lambda client: sum(client.delete(name) for name in names) if self.cluster
                                  else client.delete(*names)))
        except SharedUnavailable:
            return 0

    def delete_many(self, blocks: Iterable[tuple[bytes, bytes]]) -> int:
        return self.delete_keys([block_key(ns, key, self.rank) for ns, key in blocks])

    # ---- measurement and state ------------------------------------------------------------------
    def measure(self, nbytes: int = 4 << 20, pings: int = 5) -> tuple[float, float]:
        """(read GB/s as bytes per second, round trip in seconds): a few PINGs, then one value of
        ``nbytes`` written and read back twice (the best read counts)."""
        rtt = min(self.ping() for _ in range(pings))
        name = b"kvt1:probe:%d:%d" % (os.getpid(), self.rank)
        data = os.urandom(nbytes)
        self._call(lambda client: client.set(name, data, ex=60))
        best = float("inf")
        try:
            for _ in range(2):
                start = time.perf_counter()
                value = self._call(lambda client: client.get(name))
                best = min(best, time.perf_counter() - start)
                if value is None or len(value) != nbytes:
                    raise SharedUnavailable(f"shared store {self.url} lost a probe value at once (evicting?)")
        finally:
            try:
                self._call(lambda client: client.delete(name))
            except SharedUnavailable:
                pass
        self.rtt_s, self.read_bps = rtt, nbytes / max(best - rtt, best / 2)
        return self.read_bps, rtt

    def server_info(self) -> dict:
        """Memory, eviction and key counts as the server reports them (summed over a cluster's nodes)."""
        fields = ("used_memory", "maxmemory", "evicted_keys", "expired_keys")

        def read(client):
            info = client.info()
            nodes = list(info.values()) if self.cluster and all(isinstance(v, dict) for v in info.values()) else [info]
            merged = {name: sum(int(node.get(name, 0) or 0) for node in nodes) for name in fields}
            merged["nodes"] = len(nodes)
            merged["maxmemory_policy"] = str(nodes[0].get("maxmemory_policy", "")) if nodes else ""
            return merged

        return self._call(read)

    def stats(self) -> dict:
        return {"url": self.url, "state": self.state, "problem": self.problem, "cluster": self.cluster,
                "counters": dict(self.counters)}

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass


def _as_bytes_view(buffer, writable: bool = False) -> memoryview:
    """A flat byte view of a uint8 tensor, numpy array, bytes or bytearray (no copy)."""
    if hasattr(buffer, "numpy"):  # a torch tensor (on the CPU)
        buffer = buffer.numpy()
    view = memoryview(buffer)
    if view.ndim != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")
    if writable and view.readonly:
        raise StorageError("shared tier: read-only destination buffer")
    return view
