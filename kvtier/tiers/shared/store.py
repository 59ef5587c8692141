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

``SharedStore`` is the facade over its parts: the connection and its health (``client.SharedClient``),
the keys that sign and verify values (``values.ValueSigner``), the blocks (``blocks.SharedBlocks``)
and the session entries (``sessions.SessionEntries``).
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

from kvtier.errors import SharedUnavailable
from kvtier.tiers.base import BlockStore
from kvtier.tiers.health import Clock
from kvtier.tiers.shared.blocks import SharedBlocks
from kvtier.tiers.shared.client import BACKOFF_MAX_S, BACKOFF_MIN_S, SharedClient  # noqa: F401 - re-exported
from kvtier.tiers.shared.config import SHARED_POLICIES, SharedConfig, load_credentials, parse_shared_url
from kvtier.tiers.shared.keys import block_key
from kvtier.tiers.shared.sessions import SessionEntries
from kvtier.tiers.shared.values import VALUE_PREFIX, ForeignValue, ValueSigner

__all__ = ["SharedConfig", "SharedStore", "SharedUnavailable", "block_key", "parse_shared_url",
           "load_credentials", "SHARED_POLICIES", "VALUE_PREFIX", "ForeignValue"]

T = TypeVar("T")


class SharedStore(BlockStore):
    """One box's (one rank's) client of the shared store. Thread-safe. ``clock`` (``time.monotonic``
    by default) times the back-off: a test moves it instead of sleeping through one."""

    name = "shared"

    def __init__(self, config: SharedConfig, rank: int = 0, env: Mapping[str, str] | None = None,
                 clock: Clock = time.monotonic):
        self.config = config
        self.rank = rank
        self.client = SharedClient(config, rank, env, clock)
        self.signer = ValueSigner(rank, clock)
        self.blocks = SharedBlocks(self.client, self.signer, rank, config.ttl_s)
        self.sessions = SessionEntries(self.client, self.signer, config.ttl_s)

    # ---- the connection and its health (SharedClient) ------------------------------------------
    @property
    def url(self) -> str:
        return self.client.url

    @property
    def state(self) -> str:
        """ok | down | unknown (never reached yet)."""
        return self.client.state

    @property
    def problem(self) -> str | None:
        """Why it is down, for status."""
        return self.client.problem

    @property
    def cluster(self) -> bool:
        return self.client.cluster

    @property
    def username(self) -> str | None:
        return self.client.username

    @property
    def password(self) -> str | None:
        return self.client.password

    @property
    def rtt_s(self) -> float | None:
        return self.client.rtt_s

    @property
    def read_bps(self) -> float | None:
        return self.client.read_bps

    @property
    def available(self) -> bool:
        """Whether a call now would be tried (not inside a back-off)."""
        return self.client.available

    @property
    def counters(self) -> Counter[str]:
        """Every part's counters, summed (a fresh ``Counter``: read it, do not write to it)."""
        total: Counter[str] = Counter()
        for part in (self.client, self.signer, self.blocks, self.sessions):
            total.update(part.counters)
        return total

    def retry_now(self) -> None:
        """End the back-off at once (the operator fixed the store): the next call is the probe."""
        self.client.retry_now()

    def _call(self, fn: Callable[[Any], T]) -> T:
        """``fn(client)`` on the tier's own redis client, under the back-off (``SharedClient.call``)."""
        return self.client.call(fn)

    def ping(self) -> float:
        """One round trip, in seconds (raises ``SharedUnavailable``)."""
        return self.client.ping()

    def measure(self, nbytes: int = 4 << 20, pings: int = 5) -> tuple[float, float]:
        """(read bytes per second, round trip in seconds): see ``SharedClient.measure``."""
        return self.client.measure(nbytes, pings)

    def server_info(self) -> dict:
        """Memory, eviction and key counts as the server reports them (summed over a cluster's nodes)."""
        return self.client.server_info()

    def stats(self) -> dict:
        return {"url": self.url, "state": self.state, "problem": self.problem, "cluster": self.cluster,
                "counters": dict(self.counters)}

    def close(self) -> None:
        self.client.close()

    # ---- values (ValueSigner) -------------------------------------------------------------------
    def _signing_key(self) -> bytes | None:
        return self.signer.signing_key()

    def encode_value(self, namespace: bytes, key: bytes, payload, codec: str, fingerprint: bytes) -> bytes:
        """One block as stored: header, its signature, payload (as one bytes object)."""
        return self.signer.encode_value(namespace, key, payload, codec, fingerprint)

    def value_parts(self, namespace: bytes, key: bytes, payload, codec: str, fingerprint: bytes) -> tuple:
        """(header and signature, payload view): what ``ZeroCopyPacker`` sends as one value."""
        return self.signer.value_parts(namespace, key, payload, codec, fingerprint)

    def decode_value(self, value: bytes | None, namespace: bytes, key: bytes, fingerprint: bytes):
        """The payload and codec of a stored value, after every check (``ForeignValue`` if refused)."""
        return self.signer.decode_value(value, namespace, key, fingerprint)

    # ---- blocks (SharedBlocks) ------------------------------------------------------------------
    def write_batch(self, blocks: Sequence[tuple[bytes, bytes, Any, str]],
                    fingerprint: bytes) -> list[BaseException | None]:
        """Put ``(namespace, key, payload, codec)`` blocks, one pipeline, each with the TTL."""
        return self.blocks.write_batch(blocks, fingerprint)

    def read_batch(self, reads: Sequence[tuple[bytes, bytes, Any]], fingerprint: bytes) -> list:
        """Get and verify ``(namespace, key, destination)`` blocks, one pipeline (``SharedBlocks.read_batch``)."""
        return self.blocks.read_batch(reads, fingerprint)

    def lengths(self, namespace: bytes, keys: Sequence[bytes], ranks: int = 1) -> list[int]:
        """Payload bytes of each block as stored, 0 where any rank's shard is missing."""
        return self.blocks.lengths(namespace, keys, ranks)

    stored_prefix = staticmethod(SharedBlocks.stored_prefix)

    def delete_keys(self, names: Sequence[bytes]) -> int:
        return self.blocks.delete_keys(names)

    def delete_many(self, blocks: Iterable[tuple[bytes, bytes]]) -> int:
        return self.blocks.delete_many(blocks)

    # ---- session entries (SessionEntries) -------------------------------------------------------
    def publish_sessions(self, fingerprint: bytes, entries: Sequence[dict]) -> int:
        """Publish session entries: what another box needs to list and restore them."""
        return self.sessions.publish_sessions(fingerprint, entries)

    def unpublish_session(self, fingerprint: bytes, session_id: str) -> None:
        self.sessions.unpublish_session(fingerprint, session_id)

    def session_entry(self, fingerprint: bytes, session_id: str) -> dict | None:
        """A published session (keys as bytes, token ids as a list), or None."""
        return self.sessions.session_entry(fingerprint, session_id)

    def list_sessions(self, fingerprint: bytes, limit: int = 1000) -> list[dict]:
        """The sessions published for this model, newest first, without their keys and token ids."""
        return self.sessions.list_sessions(fingerprint, limit)
