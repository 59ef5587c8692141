"""The session catalog: what a restart needs to know about sessions, in SQLite next to the NVMe tier.

NVMe block files say which blocks exist, not which session they belong to. The catalog keeps, per
session: its ordered block keys and token ids (what a snapshot needs), token count, pin (and when a
timed pin ends), a request's retention hint, creation and last use, namespace. A restart reads it
back, so every session whose blocks are on NVMe is listed (``cold``), keeps its pin (one whose time
ran out meanwhile is dropped), and can be inspected, pinned or snapshotted before its next turn.

Why SQLite (standard library, WAL mode): atomic multi-row transactions, crash safety that is
tested far beyond anything home-made, readers that never block the writer, and a file an operator
can open with ``sqlite3``. ``synchronous=FULL`` in WAL mode syncs the log at each commit, so a
commit that returned survives a power cut too (``NORMAL`` would sync only at checkpoints and could
lose every commit since the last one: minutes of sessions). Commits are batched (about one a
second, and one per admin write), so that is one ``fdatasync`` a second, off the step path.

One catalog per NVMe directory and model fingerprint: ``<nvme_dir>/catalog/<fingerprint>.sqlite``.
Trust, checked when the file is opened and row by row:
* ``meta`` names the schema version and the fingerprint: another version's or another model's
  file is moved aside (``*.bad-<time>``) with a warning and a fresh catalog starts;
* a file SQLite cannot read (truncated, overwritten) is moved aside the same way;
* each row carries an xxh3 of its fields (and one of its token ids): a row that fails it is
  skipped and counted, never misread;
* a lock file (``flock``) held for the catalog's life refuses a second server on the same NVMe
  directory and model with :class:`CatalogLockedError` (naming the holder's pid).

Writes are batched by the caller (the manager collects the sessions that changed at its commit
points; one transaction carries them all), so serving never waits on SQLite.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import sqlite3
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import xxhash

from kvtier.errors import KvtierError
from kvtier.layout import ModelFingerprint
from kvtier.tiers import fileio

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.plan.index import Session

__all__ = ["Catalog", "CatalogError", "CatalogLockedError", "SessionRecord", "SCHEMA_VERSION", "catalog_dir",
           "held_locks"]

log = logging.getLogger("kvtier.persist.catalog")

SCHEMA_VERSION = 1
SYNCHRONOUS = "FULL"  # a returned commit is durable (the power-cut suite holds it to that)
_TOKEN_DTYPE = "<u4"

# A session row is four columns, its fixed fields packed in ``meta`` (key length, token count, pin,
# created, last use, then an xxh3 of the whole row): start-up reads 100k sessions in a few hundred ms.
# A session with a time limit (a timed pin, a retention hint) has ``_TIMES`` between the fields and
# the xxh3; one without is written as before, so older kvtier versions still read it, and a row of
# theirs (no ``_TIMES``) reads as a session with no time limit.
# Token ids, needed only for snapshots, live in their own table so the start-up scan never reads them.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS namespaces (id INTEGER PRIMARY KEY, namespace BLOB NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    ns         INTEGER NOT NULL,
    keys       BLOB NOT NULL,
    meta       BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS tokens (session_id TEXT PRIMARY KEY, data BLOB NOT NULL, crc INTEGER NOT NULL);
"""
_META = struct.Struct("<IQbdd")  # key_len, num_tokens, pinned (-1: none), created, last_use
_TIMES = struct.Struct("<ddi")  # pin_expires (0: none), retain_until (0: none), retain_priority
_CRC = struct.Struct("<Q")


class CatalogError(KvtierError):
    """The catalog cannot be used (its directory is unusable)."""


class CatalogLockedError(CatalogError):
    """Another live process holds this catalog."""


@dataclass(slots=True)
class SessionRecord:
    session_id: str
    namespace: bytes
    keys: bytes  # ordered block keys, concatenated (``key_len`` bytes each)
    key_len: int
    num_tokens: int
    pinned: int | None  # a kvtier.plan.index.Tier value, or None
    created: float
    last_use: float
    token_ids: bytes | None = None  # little-endian uint32; None on upsert: keep the stored ones
    pin_expires: float | None = None  # wall clock when a timed pin ends
    retain_until: float | None = None  # wall clock when a retention hint ends
    retain_priority: int = 0

    def packed_meta(self) -> bytes:
        fields = _META.pack(self.key_len, self.num_tokens, -1 if self.pinned is None else self.pinned,
                            self.created, self.last_use)
        if self.pin_expires is not None or self.retain_until is not None:
            fields += _TIMES.pack(self.pin_expires or 0.0, self.retain_until or 0.0, self.retain_priority)
        return fields + _CRC.pack(_row_crc(self.session_id, self.namespace, self.keys, fields))


def _row_crc(session_id: str, namespace: bytes, keys: bytes, fields: bytes) -> int:
    return xxhash.xxh3_64_intdigest(b"".join((session_id.encode(), b"\0", namespace, keys, fields)))


def _tokens_crc(session_id: str, data: bytes) -> int:
    return _signed(xxhash.xxh3_64_intdigest(session_id.encode() + b"\0" + data))


def _signed(value: int) -> int:  # SQLite integers are signed 64-bit
    return value - (1 << 64) if value >= 1 << 63 else value


def catalog_dir(nvme_dir: str | os.PathLike) -> Path:
    return Path(nvme_dir) / "catalog"


def held_locks(nvme_dir: str | os.PathLike) -> list[tuple[Path, str]]:
    """Catalog lock files under ``nvme_dir`` that a live process holds: (path, holder pid)."""
    held = []
    directory = catalog_dir(nvme_dir)
    if not directory.is_dir():
        return held
    for lock in sorted(directory.glob("*.lock")):
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            held.append((lock, _read_pid(lock)))
        finally:
            os.close(fd)
    return held


def _read_pid(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


class Catalog:
    """One model's sessions in one NVMe directory. Thread-safe (one lock).

    Nothing is held open for writing between operations (each opens its own connection, and the
    lock file is held read-only): a disk that must be remounted read-only -- by an operator, or by
    the fault suite -- is not kept busy by kvtier; writes then fail, are retried, and warn."""

    def __init__(self, nvme_dir: str | os.PathLike, fingerprint: ModelFingerprint):
        self.fingerprint = fingerprint
        directory = catalog_dir(nvme_dir)
        try:
            fileio.mkdir(directory)
        except OSError as exc:
            raise CatalogError(f"cannot create the session catalog directory {directory}: {exc.strerror}",
                               hint="check that the NVMe directory is writable") from exc
        self.path = directory / f"{fingerprint.hex}.sqlite"
        self.warnings: list[str] = []  # what opening found and fixed (moved-aside files, bad rows)
        self.bad_rows = 0
        self.recreated = 0  # times the file vanished (its directory wiped) and was made again
        self._others: tuple[float, list[Path]] | None = None  # (when listed, other models' catalogs here)
        self._ns_ids: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self._lock_fd = self._take_lock(self.path.with_suffix(".lock"))
        try:
            self._open_checked().close()
        except BaseException:
            os.close(self._lock_fd)
            raise
        fileio.commit_point(self.path, f"{self.path}-wal")  # the schema (or what an earlier run left)
        fileio.fsync_dir(directory)  # SQLite syncs its log's directory entry, not the database's

    # ---- opening ------------------------------------------------------------------------------
    def _take_lock(self, path: Path) -> int:
        if not path.exists():
            fileio.close(fileio.open_file(path, os.O_WRONLY | os.O_CREAT, 0o600))
        fd = os.open(path, os.O_RDONLY)  # flock needs no write access; a writable fd would pin the mount
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CatalogLockedError(
                    f"the session catalog {self.path} is in use by another kvtier server (pid {_read_pid(path)})",
                    hint="give each server its own --nvme-dir, or stop the other one first") from None
            raise
        try:  # who holds it, for the error a second server gets
            fileio.write_small_file(path, f"{os.getpid()}\n".encode(), durable=False)
        except OSError:
            pass
        return fd

    @contextlib.contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
        try:
            db.execute(f"PRAGMA synchronous={SYNCHRONOUS}")
            db.execute("PRAGMA mmap_size=1073741824")  # the start-up scan reads pages without a copy each
            yield db
        finally:
            db.close()

    def _open_checked(self) -> sqlite3.Connection:
        try:
            return self._open()
        except (sqlite3.DatabaseError, _Foreign) as exc:
            reason = str(exc) if isinstance(exc, _Foreign) else f"unreadable ({exc})"
            aside = self._move_aside()
            message = f"session catalog {self.path.name} was {reason}: moved to {aside.name}, started a new one"
            log.warning("kvtier: %s", message)
            self.warnings.append(message)
            return self._open()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
        try:
            db.execute("PRAGMA journal_mode=WAL")  # kept in the file
            db.execute(f"PRAGMA synchronous={SYNCHRONOUS}")
            db.executescript(_SCHEMA)
            meta = dict(db.execute("SELECT key, value FROM meta"))
            if not meta:
                db.executemany("INSERT INTO meta VALUES (?, ?)", [
                    ("schema", str(SCHEMA_VERSION)), ("fingerprint", self.fingerprint.hex),
                    ("model", json.dumps(self.fingerprint.to_dict(), sort_keys=True)),
                    ("created", str(time.time()))])
            elif meta.get("schema") != str(SCHEMA_VERSION):
                raise _Foreign(f"written by another kvtier version (schema {meta.get('schema')!r}, "
                               f"this one reads {SCHEMA_VERSION})")
            elif meta.get("fingerprint") != self.fingerprint.hex:
                raise _Foreign(f"written for another model ({str(meta.get('fingerprint'))[:12]}, "
                               f"this engine serves {self.fingerprint.hex[:12]})")
        except BaseException:
            db.close()
            raise
        return db

    def _move_aside(self) -> Path:
        aside = self.path.with_name(f"{self.path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        for suffix in ("", "-wal", "-shm"):
            source = Path(f"{self.path}{suffix}")
            if source.exists():
                fileio.replace(source, Path(f"{aside}{suffix}"))
        return aside

    # ---- reads --------------------------------------------------------------------------------
    def load(self) -> list["Session"]:
        """Every session whose row checks out (its checksum, a valid session id and pin), built in
        one pass: 100k at start-up in a few hundred ms, their keys left as one blob each. Token ids
        are read on demand (``token_ids``)."""
        from kvtier.plan.index import _SESSION_ID, Session, Tier

        with self._lock:
            try:
                with self._connection() as db:
                    namespaces = dict(db.execute("SELECT id, namespace FROM namespaces"))
                    rows = db.execute("SELECT session_id, ns, keys, meta FROM sessions").fetchall()
            except sqlite3.DatabaseError as exc:
                return self._recover(exc)
        sessions: list[Session] = []
        append, size, timed = sessions.append, _META.size, _META.size + _TIMES.size
        unpack, crc_of, digest, join = _META.unpack_from, _CRC.unpack_from, xxhash.xxh3_64_intdigest, b"".join
        new, valid, times = Session.__new__, _SESSION_ID.match, _TIMES.unpack_from
        tiers: dict = {int(t): t for t in Tier}
        tiers[-1] = None
        for session_id, ns, keys, meta in rows:
            try:
                namespace = namespaces[ns]
                key_len, num_tokens, pinned, created, last_use = unpack(meta)
                body = len(meta) - 8  # the fields, with or without _TIMES, then the xxh3
                ok = body in (size, timed) and key_len > 0 and len(keys) % key_len == 0 and pinned in tiers and \
                    crc_of(meta, body)[0] == digest(join((session_id.encode(), b"\0", namespace, keys, meta[:body]))) \
                    and valid(session_id) is not None
                pin_expires, retain_until, priority = times(meta, size) if ok and body == timed else (0.0, 0.0, 0)
            except (KeyError, TypeError, ValueError, AttributeError, struct.error):
                ok = False
            if not ok:
                self.bad_rows += 1
                continue
            session = new(Session)  # Session.__init__'s fields, set directly: this loop is the start-up
            session.session_id, session.namespace, session._keys, session._blob = session_id, namespace, None, keys
            session._key_len, session.num_tokens = key_len, num_tokens
            session.created, session.last_use = created, last_use
            session.pinned, session.hot, session.token_ids, session.tokens_dirty = tiers[pinned], False, None, False
            session.pin_expires = pin_expires if pin_expires and pinned >= 0 else None
            session.retain_until, session.retain_priority = (retain_until, priority) if retain_until else (None, 0)
            append(session)
        if self.bad_rows:
            message = f"session catalog: {self.bad_rows} damaged rows skipped (those sessions are not listed)"
            log.warning("kvtier: %s", message)
            self.warnings.append(message)
        return sessions

    def _recover(self, exc: Exception) -> list:
        """The file broke after it was opened (a corrupted page): start over with an empty one."""
        self._ns_ids = {}
        aside = self._move_aside()
        message = f"session catalog {self.path.name} was unreadable ({exc}): moved to {aside.name}, started a new one"
        log.warning("kvtier: %s", message)
        self.warnings.append(message)
        self._open().close()
        return []

    def token_ids(self, session_id: str) -> bytes | None:
        """The session's stored token ids (little-endian uint32), or None if absent or damaged."""
        with self._lock:
            try:
                with self._connection() as db:
                    row = db.execute("SELECT data, crc FROM tokens WHERE session_id = ?", (session_id,)).fetchone()
            except sqlite3.DatabaseError:
                return None
        if row is None:
            return None
        data = bytes(row[0])
        return data if _tokens_crc(session_id, data) == row[1] else None

    def find_elsewhere(self, session_id: str) -> dict | None:
        """The model fingerprint (``ModelFingerprint.to_dict``) of another catalog in this directory
        (another model, weights or KV layout on the same NVMe dir) that lists ``session_id``, or None.
        Read-only: one indexed lookup per other catalog, each opened and closed (nothing is held open
        on another server's file). Why a session's turn found nothing: it is stored for another model."""
        others = self._other_catalogs()
        for path in others:
            try:
                db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=0.2, check_same_thread=False)
                try:
                    if db.execute("SELECT 1 FROM sessions WHERE session_id = ?", (session_id,)).fetchone() is None:
                        continue
                    row = db.execute("SELECT value FROM meta WHERE key = 'model'").fetchone()
                finally:
                    db.close()
                return json.loads(row[0]) if row else {}
            except (sqlite3.Error, ValueError, OSError):
                continue
        return None

    def _other_catalogs(self) -> list[Path]:
        """Other models' catalog files here (listed again at most every 10 s)."""
        now = time.monotonic()
        cached = self._others
        if cached is not None and now - cached[0] < 10.0:
            return cached[1]
        try:
            others = sorted(p for p in self.path.parent.glob("*.sqlite") if p != self.path)
        except OSError:
            others = []
        self._others = (now, others)
        return others

    def __len__(self) -> int:
        with self._lock, self._connection() as db:
            return int(db.execute("SELECT count(*) FROM sessions").fetchone()[0])

    # ---- writes -------------------------------------------------------------------------------
    def write(self, upserts: Sequence[SessionRecord], deletes: Iterable[str] = ()) -> None:
        """One transaction: insert or replace ``upserts`` (keeping stored token ids where a record has
        none), delete ``deletes``."""
        deletes = [(d,) for d in deletes]
        if not upserts and not deletes:
            return
        with self._lock:
            if not self.path.exists():  # the NVMe directory was wiped under us: start a new catalog there
                self._recreate()
            self._write(upserts, deletes)

    def _recreate(self) -> None:
        os.close(self._lock_fd)
        self._lock_fd = -1
        fileio.mkdir(catalog_dir(self.path.parent.parent))
        self._lock_fd = self._take_lock(self.path.with_suffix(".lock"))
        self._ns_ids = {}
        self._open().close()
        self.recreated += 1

    def _write(self, upserts: Sequence[SessionRecord], deletes: list[tuple[str]]) -> None:
        fileio.acknowledge("sessions", *[("drop", d, b"") for (d,) in deletes])  # no longer owed from here
        with self._connection() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                ns_ids = self._namespace_ids(db, {r.namespace for r in upserts})
                db.executemany("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?)",
                               [(r.session_id, ns_ids[r.namespace], r.keys, r.packed_meta()) for r in upserts])
                db.executemany("INSERT OR REPLACE INTO tokens VALUES (?, ?, ?)",
                               [(r.session_id, r.token_ids, _tokens_crc(r.session_id, r.token_ids))
                                for r in upserts if r.token_ids is not None])
                db.executemany("DELETE FROM sessions WHERE session_id = ?", deletes)
                db.executemany("DELETE FROM tokens WHERE session_id = ?", deletes)
                db.execute("COMMIT")
            except BaseException:
                self._ns_ids = {}
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
        # SQLite did the IO itself: the files it leaves behind are this commit's state
        fileio.commit_point(self.path, f"{self.path}-wal")
        fileio.acknowledge("sessions", *[("put", r.session_id, r.keys) for r in upserts])

    def _namespace_ids(self, db: sqlite3.Connection, namespaces: set[bytes]) -> dict[bytes, int]:
        """Ids of ``namespaces`` in the namespaces table (added as needed; inside the write's transaction)."""
        known = self._ns_ids
        for namespace in namespaces - known.keys():
            db.execute("INSERT OR IGNORE INTO namespaces (namespace) VALUES (?)", (namespace,))
            known[namespace] = db.execute("SELECT id FROM namespaces WHERE namespace = ?", (namespace,)).fetchone()[0]
        return known

    def close(self) -> None:
        with self._lock:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1


class _Foreign(Exception):
    """The file is a valid catalog, but not this version's or this model's."""


def encode_tokens(token_ids) -> bytes:
    import numpy as np

    return np.asarray(token_ids, dtype=_TOKEN_DTYPE).tobytes()


def decode_tokens(data: bytes):
    import numpy as np

    return np.frombuffer(data, dtype=_TOKEN_DTYPE).astype(np.uint32)
