"""The one small interface of the tiers behind DRAM: the NVMe tier and the shared tier.

DRAM is the arena the manager hands out slot by slot (``tiers/dram.py``); every tier behind it
stores whole blocks by ``(namespace, key)`` and is driven in batches, so that a tier can turn a
batch into what its medium wants (one group commit and merged reads on a disk, one pipeline on a
network store). The mover reads and writes both through these three calls; each reports per
block, so one bad block never fails its neighbours.
"""
from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

__all__ = ["BlockStore", "DiskStore"]


@runtime_checkable
class BlockStore(Protocol):
    name: str  # "nvme", "shared": for logs, links and status

    def write_batch(self, blocks: Sequence[tuple[bytes, bytes, Any, str]], fingerprint: bytes) -> list:
        """Store ``(namespace, key, payload, codec)`` blocks; per block None (or the tier's own
        success value) or the exception that stopped it."""

    def read_batch(self, reads: Sequence[tuple[bytes, bytes, Any]], fingerprint: bytes) -> list:
        """Read ``(namespace, key, destination)`` blocks, each verified (header, checksum) before it
        counts; per block ``(nbytes, codec)`` or the exception (missing, damaged, unreachable)."""

    def delete_many(self, names: Iterable[tuple[bytes, bytes]]) -> int:
        """Forget blocks; returns how many were there."""


@runtime_checkable
class DiskStore(BlockStore, Protocol):
    """A ``BlockStore`` on a local filesystem (the NVMe tier): what the mover also needs from a disk.

    The shared tier is a plain ``BlockStore``; the mover asks only a ``DiskStore`` these."""

    recreated: int  # times the directory vanished and was made again (what it held is gone)

    def has(self, namespace: bytes, key: bytes) -> bool:
        """Whether the block is stored (no IO)."""

    def size_of(self, namespace: bytes, key: bytes) -> int | None:
        """Payload bytes of a stored block, None when it is not stored (no IO)."""

    def read_into(self, namespace: bytes, key: bytes, dst: Any, fingerprint: bytes) -> tuple[int, str]:
        """Read and verify one block into ``dst``; ``(nbytes, codec)``, or raises what ``read_batch``
        would report for it."""

    def free_bytes(self) -> int | None:
        """Bytes the filesystem under the tier has free (None if it cannot say)."""
