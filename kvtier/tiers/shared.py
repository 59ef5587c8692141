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
(``kvtier.trust``; boxes that share a store share that keys file), and a value no trusted key
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

import base64
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import urlsplit, urlunsplit

from kvtier.errors import ConfigError, CorruptBlockError, StorageError, UsageError

__all__ = ["SharedConfig", "SharedStore", "SharedUnavailable", "block_key", "parse_shared_url",
           "load_credentials", "SHARED_POLICIES", "VALUE_PREFIX"]

log = logging.getLogger(__name__)

SHARED_POLICIES = ("write-through", "demote")
SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss", "unix": "unix"}
_HEADER_BYTES = 176  # records._HEADER.size + its 8-byte checksum
_MAC_BYTES = 16
VALUE_PREFIX = _HEADER_BYTES + _MAC_BYTES
_ENTRY_MAGIC = b"KVSS"
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 8.0


class SharedUnavailable(StorageError):
    """The shared store cannot be used right now (down, paused, full, refusing our credentials)."""


class ForeignValue(CorruptBlockError):
    """A value in the shared store that is not a block this box may serve."""


# ---- configuration -------------------------------------------------------------------------------
def parse_shared_url(url: str) -> str:
    """Check a ``--shared`` URL and return it in the form the client takes (``valkey://`` is
    ``redis://``). A password in it is refused: it would sit in argv, ``ps`` and shell history."""
    text = (url or "").strip()
    hint = "e.g. --shared redis://10.0.0.5:6379/0, rediss://host:6380, or unix:///run/valkey.sock"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise UsageError(f"invalid --shared URL {url!r}: {exc}", hint=hint) from None
    scheme = SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise UsageError(f"invalid --shared URL {url!r}: unknown scheme {parts.scheme!r}", hint=hint)
    if parts.password is not None:
        raise UsageError("the --shared URL holds a password; it would be visible in `ps` and shell history",
                         hint="put it in a file named by --shared-auth-file (mode 600), or in "
                              "KVTIER_SHARED_PASSWORD (and KVTIER_SHARED_USERNAME for an ACL user)")
    if scheme == "unix":
        if not parts.path:
            raise UsageError(f"invalid --shared URL {url!r}: no socket path", hint=hint)
    elif not parts.hostname:
        raise UsageError(f"invalid --shared URL {url!r}: no host", hint=hint)
    if port is not None and not 0 < port < 65536:
        raise UsageError(f"invalid --shared URL {url!r}: port {port}", hint=hint)
    db = parts.path.strip("/") if scheme != "unix" else ""
    if db and not db.isdigit():
        raise UsageError(f"invalid --shared URL {url!r}: database {db!r} is not a number", hint=hint)
    if scheme == "unix":  # urlunsplit would drop the "//" of an empty host
        return f"unix://{parts.path}" + (f"?{parts.query}" if parts.query else "")
    return urlunsplit((scheme, parts.netloc, parts.path, parts.query, ""))


def display_url(url: str) -> str:
    """The URL without any user name (what status and logs show)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def load_credentials(auth_file: str | None = None, env: Mapping[str, str] | None = None) -> tuple[str | None,
                                                                                                  str | None]:
    """(username, password) from ``auth_file`` (one line: the password; two lines: user name, then
    password; mode 600 required) or ``KVTIER_SHARED_USERNAME`` / ``KVTIER_SHARED_PASSWORD``."""
    env = os.environ if env is None else env
    if auth_file:
        from kvtier.secrets import read_private_file

        text = read_private_file(auth_file, "--shared-auth-file",
                                 "a file with the password (or a user name line, then the password), mode 600")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if len(lines) not in (1, 2):
            raise ConfigError(f"--shared-auth-file {auth_file}: expected 1 line (password) or 2 (user name, "
                              f"password), found {len(lines)}", hint="one value per line, nothing else")
        return (lines[0] if len(lines) == 2 else env.get("KVTIER_SHARED_USERNAME") or None), lines[-1]
    return env.get("KVTIER_SHARED_USERNAME") or None, env.get("KVTIER_SHARED_PASSWORD") or None


@dataclass(frozen=True)
class SharedConfig:
    """How to reach the store and how to use it (parsed from the connector's extra config)."""

    url: str
    policy: str = "write-through"
    ttl_s: int = 24 * 3600
    timeout_s: float = 0.5
    codec: str = "none+zstd"
    auth_file: str | None = None
    ca_file: str | None = None

    @classmethod
    def from_connector(cls, config) -> "SharedConfig | None":
        """From the connector's ``kvtier.connector_config.ConnectorConfig`` (None: no shared tier)."""
        if not config.shared:
            return None
        if config.shared_policy not in SHARED_POLICIES:
            raise ConfigError(f"unknown shared policy {config.shared_policy!r}",
                              hint=f"one of: {', '.join(SHARED_POLICIES)}")
        return cls(parse_shared_url(config.shared), config.shared_policy, config.shared_ttl_s, config.shared_timeout_s,
                   config.shared_codec, config.shared_auth_file, config.shared_ca_file)


# ---- keys ----------------------------------------------------------------------------------------
def block_key(namespace: bytes, key: bytes, rank: int = 0) -> bytes:
    return b"kvt1:b:%s:%s:%d" % (namespace.hex().encode(), key.hex().encode(), rank)


def _entry_key(fingerprint: bytes, session_id: str) -> bytes:
    return b"kvt1:s:%s:%s" % (fingerprint.hex().encode(), session_id.encode())


def _sessions_key(fingerprint: bytes) -> bytes:
    return b"kvt1:sessions:%s" % fingerprint.hex().encode()


# ---- the store -----------------------------------------------------------------------------------
class SharedStore:
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
        self._keys: list[bytes] | None = None  # trusted keys (kvtier.trust), loaded on first use
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
                                               connection_class=_packed_connection(self.config.url), **common)
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
        from kvtier.trust import load_keys

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
            from kvtier.trust import signing_key

            try:
                self._sign = signing_key()
            except (ConfigError, OSError) as exc:
                log.warning("kvtier: shared tier values are written unsigned (other boxes refuse them): %s", exc)
                self._sign = b""
        return self._sign or None

    def _mac(self, data: bytes) -> bytes:
        from kvtier.trust import sign

        key = self._signing_key()
        return sign(key, data) if key else bytes(_MAC_BYTES)

    def _verified(self, data: bytes, mac: bytes) -> bool:
        from kvtier.trust import verify

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
                                    "(kvtier.trust: $KVTIER_SNAPSHOT_KEYS or ~/.config/kvtier/snapshot-keys)")
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
            got = self._call(lambda client: _get_into(client, names, targets) if not self.cluster
                             else _copy_into(_pipeline_get(client, names), targets))
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

    def delete_keys(self, names: Sequence[bytes]) -> int:
        try:
            return int(self._call(lambda client: sum(client.delete(name) for name in names) if self.cluster
                                  else client.delete(*names)))
        except SharedUnavailable:
            return 0

    def delete_many(self, blocks: Iterable[tuple[bytes, bytes]]) -> int:
        return self.delete_keys([block_key(ns, key, self.rank) for ns, key in blocks])

    # ---- sessions -------------------------------------------------------------------------------
    def publish_sessions(self, fingerprint: bytes, entries: Sequence[dict]) -> int:
        """Publish session entries (``session_id``, ``namespace``, ``keys``, ``token_ids``, ``num_tokens``,
        ``pinned``, ``box``, ``codec``): what another box needs to list and restore them."""
        if not entries:
            return 0
        import orjson

        ttl, index = self.config.ttl_s, _sessions_key(fingerprint)
        now = time.time()
        blobs = []
        for entry in entries:
            body = orjson.dumps({**entry, "v": 1, "published": now,
                                 "namespace": entry["namespace"].hex(),
                                 "keys": base64.b64encode(b"".join(entry["keys"])).decode(),
                                 "key_len": len(entry["keys"][0]) if entry["keys"] else 0,
                                 "token_ids": base64.b64encode(_tokens_bytes(entry.get("token_ids"))).decode()})
            blobs.append((entry["session_id"], _ENTRY_MAGIC + self._mac(body) + body))

        def publish(client):
            pipe = client.pipeline(transaction=False)
            for session_id, blob in blobs:
                pipe.set(_entry_key(fingerprint, session_id), blob, ex=ttl)
            pipe.zadd(index, {session_id: now for session_id, _ in blobs})
            pipe.expire(index, ttl)
            return pipe.execute()

        self._call(publish)
        self.counters["sessions_published"] += len(blobs)
        return len(blobs)

    def unpublish_session(self, fingerprint: bytes, session_id: str) -> None:
        def remove(client):
            pipe = client.pipeline(transaction=False)
            pipe.delete(_entry_key(fingerprint, session_id))
            pipe.zrem(_sessions_key(fingerprint), session_id)
            return pipe.execute()

        self._call(remove)

    def session_entry(self, fingerprint: bytes, session_id: str) -> dict | None:
        """A published session (keys as bytes, token ids as a list), or None: missing, expired, or
        not signed by a trusted key."""
        blob = self._call(lambda client: client.get(_entry_key(fingerprint, session_id)))
        return self._parse_entry(blob, full=True)

    def list_sessions(self, fingerprint: bytes, limit: int = 1000) -> list[dict]:
        """The sessions other boxes (and this one) published for this model, newest first, without
        their keys and token ids."""
        index = _sessions_key(fingerprint)
        ids = self._call(lambda client: client.zrevrange(index, 0, limit - 1))
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i in ids]
        if not ids:
            return []

        def get_all(client):
            pipe = client.pipeline(transaction=False)
            for session_id in ids:
                pipe.get(_entry_key(fingerprint, session_id))
            return pipe.execute()

        blobs = self._call(get_all)
        out, gone = [], []
        for session_id, blob in zip(ids, blobs):
            entry = self._parse_entry(blob, full=False)
            if entry is None or entry.get("session_id") != session_id:
                gone.append(session_id)
                continue
            out.append(entry)
        if gone:  # expired or evicted entries: tidy the index
            try:
                self._call(lambda client: client.zrem(index, *gone))
            except SharedUnavailable:
                pass
        return out

    def _parse_entry(self, blob: bytes | None, full: bool) -> dict | None:
        import orjson

        if not blob or not blob.startswith(_ENTRY_MAGIC) or len(blob) < 4 + _MAC_BYTES:
            return None
        mac, body = blob[4 : 4 + _MAC_BYTES], blob[4 + _MAC_BYTES :]
        if not self._verified(body, mac):
            self.counters["rejected_entries"] += 1
            return None
        try:
            entry = orjson.loads(body)
            key_len = int(entry.get("key_len") or 0)
            keys = base64.b64decode(entry["keys"])
            entry["blocks"] = len(keys) // key_len if key_len else 0
            if full:
                import numpy as np

                entry["keys"] = [keys[i : i + key_len] for i in range(0, len(keys), key_len)] if key_len else []
                entry["token_ids"] = np.frombuffer(base64.b64decode(entry["token_ids"]), dtype="<u4").tolist()
                entry["namespace"] = bytes.fromhex(entry["namespace"])
            else:
                del entry["keys"], entry["token_ids"]
            return entry
        except (ValueError, KeyError, TypeError):
            self.counters["rejected_entries"] += 1
            return None

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


class ZeroCopyPacker:
    """redis-py's command packer (RESP), except that a value given as a tuple of buffers is sent as
    one bulk string made of them, and large buffers go to the socket as they are: a block's header
    and its payload (a view of a DRAM slot) are never joined or copied (redis-py with hiredis copies
    every value into one packed command)."""

    LARGE = 16 << 10

    @staticmethod
    def _encode(arg) -> bytes | memoryview:
        if isinstance(arg, (bytes, memoryview)):
            return arg
        if isinstance(arg, bytearray):
            return bytes(arg)
        if isinstance(arg, str):
            return arg.encode()
        if isinstance(arg, bool):
            raise TypeError("booleans are not redis values")
        if isinstance(arg, (int, float)):
            return repr(arg).encode()
        raise TypeError(f"cannot send {type(arg).__name__} to redis")

    def pack(self, *args) -> list:
        if isinstance(args[0], str):  # 'CONFIG GET' style names: separate words
            args = tuple(args[0].encode().split()) + args[1:]
        out: list = []
        small: list = [b"*%d\r\n" % len(args)]
        for arg in args:
            parts = [self._encode(p) for p in arg] if isinstance(arg, tuple) else [self._encode(arg)]
            small.append(b"$%d\r\n" % sum(len(p) for p in parts))
            for part in parts:
                if len(part) >= self.LARGE:
                    out.append(b"".join(small))
                    out.append(part if isinstance(part, memoryview) else memoryview(part))
                    small = []
                else:
                    small.append(part)
            small.append(b"\r\n")
        out.append(b"".join(small))
        return out


def _packed_connection(url: str):
    """A redis-py connection class (TCP or TLS) that packs with ``ZeroCopyPacker`` (cluster clients
    take a class, not packer arguments)."""
    from redis.connection import Connection, SSLConnection

    base = SSLConnection if url.startswith("rediss://") else Connection

    class Packed(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("command_packer", ZeroCopyPacker())
            super().__init__(*args, **kwargs)

    return Packed


def _copy_into(values: Sequence[bytes | None], targets: Sequence[memoryview]) -> list:
    """``_get_into``'s answer from values already read (a cluster's pipeline)."""
    out: list = []
    for value, target in zip(values, targets):
        if value is None:
            out.append(None)
            continue
        n = min(max(len(value) - VALUE_PREFIX, 0), len(target))
        target[:n] = memoryview(value)[VALUE_PREFIX : VALUE_PREFIX + n]
        out.append((value[:VALUE_PREFIX], len(value)))
    return out


class _Replies:
    """Reads RESP2 replies of pipelined GETs from a socket, bulk values straight into buffers."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the shared store closed the connection")
        self.buf += chunk

    def line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buf[:end])
                del self.buf[: end + 2]
                return line
            if len(self.buf) > 1 << 16:
                raise ConnectionError("the shared store sent a reply line over 64 KiB")
            self._fill()

    def into(self, view: memoryview) -> None:
        """Exactly ``len(view)`` bytes into ``view``: what is buffered first, then from the socket."""
        have = min(len(self.buf), len(view))
        if have:
            view[:have] = self.buf[:have]
            del self.buf[:have]
        while have < len(view):
            got = self.sock.recv_into(view[have:])
            if not got:
                raise ConnectionError("the shared store closed the connection")
            have += got

    def skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            step = min(n, len(scratch))
            self.into(scratch[:step])
            n -= step


def _get_into(client, names: Sequence[bytes], targets: Sequence[memoryview]) -> list:
    """Pipelined GETs on one connection of a standalone store, each value's header and signature
    into a small buffer and its payload straight from the socket into its target (no bytes object,
    no copy). Returns per name None (missing) or (prefix, value length). Any fault leaves the
    connection closed, never half-read."""
    import redis

    pool = client.connection_pool
    conn = pool.get_connection()  # (redis-py: checks it is healthy and connects it)
    try:
        conn.send_packed_command(conn.pack_commands([("GET", name) for name in names]))
        replies = _Replies(conn._sock)
        out: list = []
        for target in targets:
            head = replies.line()
            if head.startswith(b"-"):  # e.g. WRONGTYPE: something else under our key: refused, not served
                out.append((b"", -1))
                continue
            if not head.startswith((b"$", b"_")):
                raise redis.ConnectionError(f"unexpected reply to GET: {head[:40]!r}")
            if head == b"_":  # RESP3's null, should the server speak it anyway
                out.append(None)
                continue
            total = int(head[1:])
            if total < 0:
                out.append(None)
                continue
            prefix = bytearray(min(total, VALUE_PREFIX))
            replies.into(memoryview(prefix))
            body = total - len(prefix)
            room = min(body, len(target))
            replies.into(target[:room])
            replies.skip(body - room)
            replies.into(memoryview(bytearray(2)))  # CRLF
            out.append((bytes(prefix), total))
        if replies.buf:
            raise redis.ConnectionError("the shared store sent more than was asked")
        return out
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _pipeline_get(client, names: Sequence[bytes]) -> list:
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(name)
    return pipe.execute()


def _tokens_bytes(token_ids) -> bytes:
    import numpy as np

    if token_ids is None:
        return b""
    return np.asarray(token_ids, dtype="<u4").tobytes()


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
