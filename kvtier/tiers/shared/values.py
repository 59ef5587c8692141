"""A block's value in the shared store: ``[176-byte record header][16-byte HMAC of the header][payload]``.

``ValueSigner`` owns the keys that sign and verify values (this box's signing key and the trusted
keys of ``kvtier.persist.trust``, loaded on first use and re-read at most every 10 s when a value
fails to verify) and the checks a value passes before it is served. The header is the NVMe
record's (``kvtier.tiers.records``), so a value is verified alone: under the wrong key, of another
model, rank or tenant, truncated or damaged, it is refused. Checksums prove a value intact, not who
wrote it -- anyone who can write to the store can write valid checksums -- so the header is signed
too, and a value no trusted key signed is refused. Session entries are signed with the same keys
(``mac`` / ``verified``).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

from kvtier.errors import ConfigError, CorruptBlockError, StorageError

__all__ = ["ForeignValue", "ValueSigner", "VALUE_PREFIX", "HEADER_BYTES", "MAC_BYTES", "as_bytes_view"]

log = logging.getLogger(__name__)

HEADER_BYTES = 176  # records._HEADER.size + its 8-byte checksum
MAC_BYTES = 16
VALUE_PREFIX = HEADER_BYTES + MAC_BYTES
TRUSTED_REFRESH_S = 10.0  # a value that fails to verify re-reads the trusted keys at most this often


class ForeignValue(CorruptBlockError):
    """A value in the shared store that is not a block this box may serve."""


class ValueSigner:
    """Signs and verifies this rank's values and session entries. Counts ``rejected_unsigned``."""

    def __init__(self, rank: int = 0, clock: Callable[[], float] = time.monotonic):
        self.rank = rank
        self.clock = clock
        self.counters: Counter[str] = Counter()
        self._keys: list[bytes] | None = None  # trusted keys (kvtier.persist.trust), loaded on first use
        self._keys_at = 0.0
        self._sign: bytes | None = None

    # ---- keys -----------------------------------------------------------------------------------
    def trusted(self, refresh: bool = False) -> list[bytes]:
        from kvtier.persist.trust import load_keys

        now = self.clock()
        if self._keys is None or (refresh and now - self._keys_at > TRUSTED_REFRESH_S):
            try:
                self._keys = load_keys()
            except ConfigError as exc:
                log.warning("kvtier: shared tier: %s", exc)
                self._keys = []
            self._keys_at = now
        return self._keys

    def signing_key(self) -> bytes | None:
        """This box's signing key, None when it has none (values then go out unsigned)."""
        if self._sign is None:
            from kvtier.persist.trust import signing_key

            try:
                self._sign = signing_key()
            except (ConfigError, OSError) as exc:
                log.warning("kvtier: shared tier values are written unsigned (other boxes refuse them): %s", exc)
                self._sign = b""
        return self._sign or None

    def mac(self, data: bytes) -> bytes:
        from kvtier.persist.trust import sign

        key = self.signing_key()
        return sign(key, data) if key else bytes(MAC_BYTES)

    def verified(self, data: bytes, mac: bytes) -> bool:
        from kvtier.persist.trust import verify

        return verify(self.trusted(), data, mac) or verify(self.trusted(refresh=True), data, mac)

    # ---- values ---------------------------------------------------------------------------------
    def encode_value(self, namespace: bytes, key: bytes, payload, codec: str, fingerprint: bytes) -> bytes:
        """One block as stored: header, its signature, payload (as one bytes object)."""
        return b"".join(self.value_parts(namespace, key, payload, codec, fingerprint))

    def value_parts(self, namespace: bytes, key: bytes, payload, codec: str, fingerprint: bytes) -> tuple:
        """(header and signature, payload view): what ``ZeroCopyPacker`` sends as one value."""
        from kvtier.tiers.records import checksum, pack_header

        data = as_bytes_view(payload)
        header = bytearray(HEADER_BYTES)
        pack_header(header, len(data), checksum(data), fingerprint, namespace, codec, key, self.rank)
        return bytes(header) + self.mac(bytes(header)), data

    def decode_value(self, value: bytes | None, namespace: bytes, key: bytes, fingerprint: bytes):
        """The payload (a memoryview) and codec of a stored value, after every check; raises
        ``ForeignValue`` for anything this box may not serve under that key."""
        if value is None:
            raise StorageError(f"shared tier: block {key.hex()[:16]} is not stored")
        payload = memoryview(value)[VALUE_PREFIX:]
        return payload, self.check(value[:VALUE_PREFIX], payload, len(value), namespace, key, fingerprint)

    def check(self, prefix: bytes, payload, total: int, namespace: bytes, key: bytes, fingerprint: bytes) -> str:
        """Verify a value (its ``prefix``: header and signature; ``payload`` as read) and return its
        codec; ``ForeignValue`` for anything this box may not serve under that key."""
        from kvtier.tiers.records import checksum, unpack_header

        name = key.hex()[:16]
        if total < VALUE_PREFIX:
            raise ForeignValue(f"shared tier: block {name}: value of {total} bytes is too short")
        header = unpack_header(prefix[:HEADER_BYTES])
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
        if not self.verified(bytes(prefix[:HEADER_BYTES]), bytes(prefix[HEADER_BYTES:VALUE_PREFIX])):
            self.counters["rejected_unsigned"] += 1
            raise ForeignValue(f"shared tier: block {name}: not signed by a key this box trusts",
                               hint="boxes that share a store must share the snapshot keys file "
                                    "(kvtier.persist.trust: $KVTIER_SNAPSHOT_KEYS or ~/.config/kvtier/snapshot-keys)")
        if checksum(payload) != header.digest:
            raise ForeignValue(f"shared tier: block {name}: payload checksum mismatch")
        return header.codec


def as_bytes_view(buffer, writable: bool = False) -> memoryview:
    """A flat byte view of a uint8 tensor, numpy array, bytes or bytearray (no copy)."""
    if hasattr(buffer, "numpy"):  # a torch tensor (on the CPU)
        buffer = buffer.numpy()
    view = memoryview(buffer)
    if view.ndim != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")
    if writable and view.readonly:
        raise StorageError("shared tier: read-only destination buffer")
    return view
