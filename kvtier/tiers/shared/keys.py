"""Names in the shared store: one key per block and rank, one per published session, one index of
sessions per model (the fingerprint covers weights, geometry, KV dtype and tensor-parallel size; the
namespace adds the tenant's cache salt)."""
from __future__ import annotations

__all__ = ["block_key", "entry_key", "sessions_key"]


def block_key(namespace: bytes, key: bytes, rank: int = 0) -> bytes:
    return b"kvt1:b:%s:%s:%d" % (namespace.hex().encode(), key.hex().encode(), rank)


def entry_key(fingerprint: bytes, session_id: str) -> bytes:
    return b"kvt1:s:%s:%s" % (fingerprint.hex().encode(), session_id.encode())


def sessions_key(fingerprint: bytes) -> bytes:
    return b"kvt1:sessions:%s" % fingerprint.hex().encode()
