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

``SharedStore`` owns the wiring of its parts, the shared tier's contract the mover uses (``available``,
``state``, ``problem``, ``counters``, the ``BlockStore`` batches) and ``close``; callers hold the part that
owns the rest: ``client`` (``SharedClient``: the connection and its health -- ``url``, ``cluster``,
``ping``, ``measure``, ``server_info``, ``retry_now``), ``signer`` (``ValueSigner``: the keys that sign
and verify values), ``blocks`` (``SharedBlocks``: ``lengths``, ``stored_prefix``, ``delete_keys``) and
``sessions`` (``SessionEntries``: ``publish_sessions``, ``session_entry``, ``list_sessions``).
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

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

    # ---- the shared tier's contract (``kvtier.move.publish.SharedTier``) ---------------------------
    @property
    def available(self) -> bool:
        """Whether a call now would be tried (not inside a back-off)."""
        return self.client.available

    @property
    def state(self) -> str:
        """ok | down | unknown (never reached yet)."""
        return self.client.state

    @property
    def problem(self) -> str | None:
        """Why it is down, for status."""
        return self.client.problem

    @property
    def counters(self) -> Counter[str]:
        """Every part's counters, summed (a fresh ``Counter``: read it, do not write to it)."""
        total: Counter[str] = Counter()
        for part in (self.client, self.signer, self.blocks, self.sessions):
            total.update(part.counters)
        return total

    def stats(self) -> dict:
        client = self.client
        return {"url": client.url, "state": client.state, "problem": client.problem, "cluster": client.cluster,
                "counters": dict(self.counters)}

    def write_batch(self, blocks: Sequence[tuple[bytes, bytes, Any, str]],
                    fingerprint: bytes) -> list[BaseException | None]:
        """Put ``(namespace, key, payload, codec)`` blocks, one pipeline, each with the TTL."""
        return self.blocks.write_batch(blocks, fingerprint)

    def read_batch(self, reads: Sequence[tuple[bytes, bytes, Any]], fingerprint: bytes) -> list:
        """Get and verify ``(namespace, key, destination)`` blocks, one pipeline (``SharedBlocks.read_batch``)."""
        return self.blocks.read_batch(reads, fingerprint)

    def delete_many(self, blocks: Iterable[tuple[bytes, bytes]]) -> int:
        return self.blocks.delete_many(blocks)

    def close(self) -> None:
        """Close the connection (whoever opened the store closes it)."""
        self.client.close()
