"""The cold tier's index: which segment, offset and length hold each block, as an append-only journal.

``<shard dir>/index.kvj``: a 64-byte file header, then fixed-size entries (144 bytes), each its own
xxh3-checksummed record::

    op (1 put, 2 drop), key_len, reserved, segment id, offset, payload bytes, namespace, codec, key, xxh3

Group commit: one batch of writes or drops is one ``write`` of its entries and one ``fdatasync``,
after the batch's block records are durable in their segment. So an entry can only name a complete
record; after a crash the journal is replayed, a torn last entry is cut off, and records written
after the last commit (a torn segment tail) are simply not named by any entry.

Why a journal and not a database: it is opened only for the moment of a commit (a file held open
for writing stops the operator or the kernel remounting the disk read-only), a commit costs exactly
one append and one ``fdatasync``, and it can always be rebuilt from the segments, whose records
verify themselves. Replay skips a damaged entry rather than trusting it: every read checks the
record it lands on (namespace, key, fingerprint, rank, checksums) anyway. The journal is rewritten
compactly (to a temp file, fsync-ed, renamed) when it holds more than twice the live entries.
"""
from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import xxhash

from kvtier.tiers import fileio
from kvtier.tiers.records import checksum

__all__ = ["Extent", "Journal", "JOURNAL_NAME"]

JOURNAL_NAME = "index.kvj"
_FILE_MAGIC = b"KVTJOURN"
_FILE_VERSION = 1
_FILE_HEADER = struct.Struct("<8sHH52s")  # magic, version, reserved, zeros: 64 bytes
_ENTRY = struct.Struct("<BBHIQQ16s32s64s")  # op key_len reserved seg offset nbytes namespace codec key
ENTRY_BYTES = _ENTRY.size + 8
_ENTRY_SEALED = struct.Struct(_ENTRY.format + "Q")  # an entry and its checksum
_PUT, _DROP = 1, 2
REWRITE_SLACK = 4096  # entries beyond twice the live ones before start-up rewrites the journal compactly
_new_extent = tuple.__new__  # Extent's own constructor without its argument handling (the replay's hot loop)


class Extent(NamedTuple):
    """Where one block's record lies: segment id, byte offset, payload bytes, codec. A tuple: a
    million of them are made at start-up, and a tuple is made in a quarter of a frozen dataclass's
    time."""

    segment: int
    offset: int
    nbytes: int
    codec: str


def _entry(op: int, namespace: bytes, key: bytes, extent: Extent | None) -> bytes:
    seg, off, nbytes, codec = (extent.segment, extent.offset, extent.nbytes, extent.codec.encode()) if extent \
        else (0, 0, 0, b"")
    body = _ENTRY.pack(op, len(key), 0, seg, off, nbytes, namespace, codec, key)
    return body + struct.pack("<Q", checksum(body))


class Journal:
    """Replay, append (group commit) and compaction of ``index.kvj``."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / JOURNAL_NAME
        self.entries = 0  # entries in the file (live or not): drives compaction
        self.damaged = 0  # entries skipped at replay (a checksum failed)

    def exists(self) -> bool:
        return self.path.is_file()

    def replay(self, repair: bool) -> dict[tuple[bytes, bytes], Extent] | None:
        """The live extents, or None when the file is missing or its header is not a journal's.
        ``repair``: cut a torn last entry off the file (a writer does; a reader must not)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        if len(data) < _FILE_HEADER.size:
            return None
        magic, version, _r, _z = _FILE_HEADER.unpack_from(data)
        if magic != _FILE_MAGIC or version != _FILE_VERSION:
            return None
        live: dict[tuple[bytes, bytes], Extent] = {}
        body = memoryview(data)[_FILE_HEADER.size :]
        whole = len(body) // ENTRY_BYTES
        self.damaged = 0
        size, codecs = _ENTRY.size, {}  # a few distinct codec names: decoded once each
        namespaces: dict[bytes, bytes] = {}  # ... and a few namespaces: one bytes object each, not one a block
        digest = xxhash.xxh3_64_intdigest
        # one C loop unpacks every entry (a million entries: the start-up's largest cost)
        for i, (op, key_len, _res, seg, off, nbytes, ns, codec, key, stored) in enumerate(
                _ENTRY_SEALED.iter_unpack(body[: whole * ENTRY_BYTES])):
            start = i * ENTRY_BYTES
            if digest(body[start : start + size]) != stored:
                self.damaged += 1
                continue
            name = (namespaces.setdefault(ns, ns), key[:key_len])
            if op == _PUT and key_len <= 64:
                text = codecs.get(codec)
                if text is None:
                    text = codecs[codec] = codec.rstrip(b"\0").decode(errors="replace")
                live[name] = _new_extent(Extent, (seg, off, nbytes, text))
            elif op == _DROP:
                live.pop(name, None)
            else:
                self.damaged += 1
        self.entries = whole
        if repair and len(body) % ENTRY_BYTES:  # a torn append: never acknowledged
            fileio.truncate(self.path, _FILE_HEADER.size + whole * ENTRY_BYTES)
        return live

    def append(self, puts: Sequence[tuple[bytes, bytes, Extent]], drops: Iterable[tuple[bytes, bytes]] = ()) -> None:
        """Make a batch of puts and drops durable: one append, one ``fdatasync``."""
        data = b"".join([_entry(_PUT, ns, key, ext) for ns, key, ext in puts]
                        + [_entry(_DROP, ns, key, None) for ns, key in drops])
        if not data:
            return
        created = not self.path.exists()
        fd = fileio.open_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            head = b"" if size else _FILE_HEADER.pack(_FILE_MAGIC, _FILE_VERSION, 0, b"")
            try:
                fileio.append(fd, head + data)
                fileio.fdatasync(fd)
            except OSError:  # a partial append would shift every later entry: take it back
                with contextlib.suppress(OSError):
                    fileio.ftruncate(fd, size)
                raise
        finally:
            fileio.close(fd)
        if created:
            fileio.fsync_dir(self.path.parent)
        self.entries += len(data) // ENTRY_BYTES

    def rewrite(self, live: dict[tuple[bytes, bytes], Extent]) -> None:
        """Replace the journal by one put per live block (atomically: temp file, fsync, rename)."""
        tmp = self.path.with_name(JOURNAL_NAME + ".tmp")
        fd = fileio.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        try:
            fileio.append(fd, _FILE_HEADER.pack(_FILE_MAGIC, _FILE_VERSION, 0, b"")
                          + b"".join(_entry(_PUT, ns, key, ext) for (ns, key), ext in live.items()))
            fileio.fdatasync(fd)
        finally:
            fileio.close(fd)
        fileio.replace(tmp, self.path)
        fileio.fsync_dir(self.path.parent)
        self.entries = len(live)

    def wants_rewrite(self, live: int) -> bool:
        return self.entries > 2 * live + REWRITE_SLACK

    def move_aside(self, why: str) -> Path | None:
        """Keep a journal that cannot be read for inspection, out of the way of a rebuilt one."""
        if not self.path.exists():
            return None
        aside = self.path.with_name(f"{JOURNAL_NAME}.bad-{why}-{os.getpid()}")
        fileio.replace(self.path, aside)
        return aside

