"""Portable session snapshots: one self-describing, checksummed file per session.

Format version 1 (integers little-endian)::

    0               preamble, 64 bytes: magic b"KVTSNAP\\0" (8s), version (u16), flags (u16, 0),
                    header_len (u64), header_xxh3 (u64, of the header_len header bytes),
                    payload_offset (u64, page aligned), file_len (u64, exact file size), zeros
    64              UTF-8 JSON header, space-padded to header_len bytes:
                    {"fingerprint": ModelFingerprint.to_dict(), "session_id", "namespace": hex,
                     "codec", "num_tokens", "token_ids": [int], "created": unix time, "meta": {},
                     "blocks": [{"key": hex, "offset": int, "nbytes": int, "xxh3": int}, ...]}
    payload_offset  block payloads in block order at page-aligned absolute offsets, each zero-padded
                    to a page; file_len = end of the last padded payload (payload_offset if none)

Writing: the header area is reserved up front at its final size (sizes and keys are known; the
header is rendered with 20-digit checksums). Blocks are copied into two page-aligned 32 MiB staging
buffers and hashed while cache-hot; an IO thread writes one (O_DIRECT where the filesystem allows)
while the other fills. The preamble and real header go in last, all into ``.<name>.tmp-<random>``
beside the target, which is fdatasync-ed, renamed into place and its directory fsync-ed: the final
path only ever holds a complete snapshot, and any failure removes the temp file.

Reading validates the preamble and header completely (magic, version, checksum, JSON types, every
offset and size inside the file, blocks ordered and disjoint, bounded counts, exact length) before
touching payloads; an IO thread reads the next large aligned chunk while the caller verifies the
current one, and a block is yielded only after its checksum matched. Every fault is a one-line
:class:`SnapshotError` (or :class:`FingerprintMismatchError`) naming the file, with a hint.
torch is imported only when a torch tensor is passed in.
"""
from __future__ import annotations

from kvtier.persist.snapshot.format import (  # noqa: F401 - the file format's constants, for tools and tests
    _PREAMBLE,
    FORMAT_VERSION,
    IO_CHUNK,
    MAGIC,
    MAX_HEADER_BYTES,
    PREAMBLE_BYTES,
    BlockEntry,
    SnapshotInfo,
    shard_path,
)
from kvtier.persist.snapshot.read import (
    header_cap,
    open_snapshot,
    overwrite_refusal,
    read_blocks,
    remove_stale_temp_files,
    verify_snapshot,
)
from kvtier.persist.snapshot.write import SnapshotWriter, write_snapshot

__all__ = ["MAGIC", "FORMAT_VERSION", "BlockEntry", "SnapshotInfo", "SnapshotWriter", "write_snapshot",
           "header_cap", "open_snapshot", "overwrite_refusal", "read_blocks", "verify_snapshot",
           "remove_stale_temp_files", "shard_path"]
