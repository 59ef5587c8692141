"""Blocks in the shared store: ``write_batch`` / ``read_batch`` / ``delete_many`` of ``(namespace, key)``
blocks, one pipeline per batch, and the ``lengths`` lookup.

``SharedBlocks`` owns the block counters and the rate limit of its "refused value" warnings; it
reaches the store through a ``SharedClient`` and signs and checks values with a ``ValueSigner``.
The store is a cache that may forget anything at any time: a missing key is a miss, never an error.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Iterable, Sequence

from kvtier.errors import SharedUnavailable, StorageError
from kvtier.tiers.shared.client import SharedClient
from kvtier.tiers.shared.keys import block_key
from kvtier.tiers.shared.resp import copy_into, get_into, pipeline_get
from kvtier.tiers.shared.values import VALUE_PREFIX, ForeignValue, ValueSigner, as_bytes_view

__all__ = ["SharedBlocks"]

log = logging.getLogger(__name__)

REJECTED_LOG_EVERY_S = 10.0


class SharedBlocks:
    """One rank's blocks in the store, each key with the TTL ``ttl_s``."""

    def __init__(self, client: SharedClient, signer: ValueSigner, rank: int = 0, ttl_s: int = 24 * 3600):
        self.client = client
        self.signer = signer
        self.rank = rank
        self.ttl_s = ttl_s
        self.counters: Counter[str] = Counter()
        self._rejected_logged = -1e9  # when a refused value was last logged
        self._rejected_seen = 0  # counters["rejected"] then

    def write_batch(self, blocks: Sequence[tuple[bytes, bytes, Any, str]],
                    fingerprint: bytes) -> list[BaseException | None]:
        """Put ``(namespace, key, payload, codec)`` blocks, one pipeline, each with the TTL. Returns
        per block None or the exception (all of them when the store is down)."""
        if not blocks:
            return []
        values = [(block_key(ns, key, self.rank), self.signer.value_parts(ns, key, payload, codec, fingerprint))
                  for ns, key, payload, codec in blocks]
        ttl = self.ttl_s

        def put(client):
            pipe = client.pipeline(transaction=False)
            for name, value in values:
                pipe.set(name, value, ex=ttl)
            return pipe.execute(raise_on_error=False)

        try:
            replies = self.client.call(put)
        except SharedUnavailable as exc:
            self.counters["put_skipped"] += len(blocks)
            return [exc] * len(blocks)
        outcomes: list[BaseException | None] = []
        for (_name, value), reply in zip(values, replies):
            if isinstance(reply, Exception):  # e.g. OOM: the store is full and evicts nothing
                self.client.failed(reply)
                outcomes.append(self.client.unavailable())
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
        targets = [as_bytes_view(dst, writable=True) for _ns, _key, dst in reads]
        try:
            got = self.client.call(lambda client: get_into(client, names, targets, VALUE_PREFIX)
                                   if not self.client.cluster
                                   else copy_into(pipeline_get(client, names), targets, VALUE_PREFIX))
        except SharedUnavailable as exc:
            self.counters["get_skipped"] += len(reads)
            return [exc] * len(reads)
        outcomes: list = []
        bad = []
        for (namespace, key, _dst), name, target, item in zip(reads, names, targets, got):
            outcome = self._verify(item, target, namespace, key, fingerprint)
            if isinstance(outcome, ForeignValue):
                bad.append(name)
            outcomes.append(outcome)
        if bad:  # never served; removed so that the next lookup misses instead of fetching it again
            self.delete_keys(bad)
        return outcomes

    def _verify(self, item, target: memoryview, namespace: bytes, key: bytes, fingerprint: bytes):
        """One read's outcome: ``(nbytes, codec)``, or the miss / refusal it is."""
        if item is None:
            self.counters["misses"] += 1
            return StorageError(f"shared tier: block {key.hex()[:16]} is not stored")
        prefix, total = item
        if total - VALUE_PREFIX > len(target):
            return StorageError(f"shared tier: block {key.hex()[:16]} holds {total - VALUE_PREFIX} "
                                f"bytes, more than its {len(target)}-byte destination")
        try:
            codec = self.signer.check(prefix, target[: max(total - VALUE_PREFIX, 0)], total, namespace, key,
                                      fingerprint)
        except ForeignValue as exc:
            self.counters["rejected"] += 1
            self._warn_rejected(exc)
            return exc
        self.counters["hits"] += 1
        self.counters["get_bytes"] += total
        return total - VALUE_PREFIX, codec

    def _warn_rejected(self, exc: BaseException) -> None:
        """Log a refused value, at most once per 10 s (with how many were refused meanwhile)."""
        now = time.monotonic()
        if now - self._rejected_logged >= REJECTED_LOG_EVERY_S:
            quiet = self.counters["rejected"] - self._rejected_seen - 1
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

        found = self.client.call(strlen)
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
            return int(self.client.call(lambda client: sum(client.delete(name) for name in names)
                                        if self.client.cluster else client.delete(*names)))
        except SharedUnavailable:
            return 0

    def delete_many(self, blocks: Iterable[tuple[bytes, bytes]]) -> int:
        return self.delete_keys([block_key(ns, key, self.rank) for ns, key in blocks])
