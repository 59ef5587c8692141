"""The session catalog's change log, and the shared tier's session entries.

``CatalogLog`` owns the catalog (read back at start: the sessions of an earlier run), which sessions
changed or went since the last write, their rows for SQLite, the lock that orders the writes, and,
with a shared tier on, which sessions changed since they were last published and their entries for
the shared store. The writes themselves run outside the engine's lock.
"""
from __future__ import annotations

import contextlib
import gc
import threading
import time
from typing import TYPE_CHECKING, Iterable

import numpy as np

from kvtier.layout import KVGeometry
from kvtier.plan.index import Session, Tier
from kvtier.plan.table import BlockTable
from kvtier.plan.telemetry import Telemetry

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.persist.catalog import Catalog

__all__ = ["CatalogLog"]

_WRITE_FAILED = "the session catalog could not be written"


class CatalogLog:
    def __init__(self, catalog: "Catalog | None", table: BlockTable, telemetry: Telemetry, geometry: KVGeometry,
                 key_scheme: str):
        """``table``: holds the live sessions (filled here from the catalog at start); ``key_scheme``:
        the hash the block keys are computed with (published with each entry)."""
        self.catalog = catalog
        self._sessions, self._table, self._telemetry = table.sessions, table, telemetry
        self._geometry, self._key_scheme = geometry, key_scheme
        self.dirty: set[str] = set()  # sessions changed since the last sync
        self.gone: set[str] = set()  # sessions dropped since then
        self._order = threading.Lock()  # one batch copied and written at a time
        self.publish_sessions = False  # a shared tier is on: changed sessions are published (shared_batch)
        self.shared_dirty: set[str] = set()
        if catalog is not None:
            self._read_back(catalog)

    def _read_back(self, catalog: "Catalog") -> None:
        """Sessions of an earlier run: listed at once (cold where their blocks are on NVMe), pins kept."""
        started = time.perf_counter()
        collecting = gc.isenabled()
        gc.disable()  # hundreds of thousands of acyclic objects: the cyclic collector would rescan them
        try:
            self._sessions.update((session.session_id, session) for session in catalog.load())
        finally:
            if collecting:
                gc.enable()
        self._time_limits()
        pin = self._table.index.col["pin"]
        for session in self._sessions.values():  # a block takes the hottest pin of the sessions holding it
            if session.pinned is not None:
                rows = self._table.session_row_array(session)
                pin[rows] = np.where(pin[rows] == 0, session.pinned, np.minimum(pin[rows], session.pinned))
        for message in catalog.warnings:
            self._telemetry.warn("catalog", message)
        self._telemetry.counters["catalog_sessions_at_start"] = len(self._sessions)
        self._telemetry.counters["catalog_start_ms"] = int((time.perf_counter() - started) * 1000)

    def _time_limits(self) -> None:
        """Timed pins and retention hints read back: those whose time ran out while no server ran are
        dropped (the sessions' rows rewritten without them), the others count again."""
        table, now = self._table, self._table.wall_clock()
        for session in self._sessions.values():
            if session.pin_expires is not None:
                if session.pin_expires > now:
                    table.timed_pins.add(session.session_id)
                else:
                    session.pinned, session.pin_expires = None, None
                    self.mark_changed(session.session_id)
                    self._telemetry.count("pins_expired")
            if session.retain_until is not None:
                if session.retain_until <= now:
                    self.mark_changed(session.session_id)
                table.retain(session, session.retain_until, session.retain_priority)

    # ---- what changed -------------------------------------------------------------------------
    def mark_changed(self, session_id: str) -> None:
        self.dirty.add(session_id)
        if self.publish_sessions:
            self.shared_dirty.add(session_id)

    def mark_all_changed(self) -> None:
        """Every session goes back into the catalog (the directory it lived in was lost)."""
        self.dirty.update(self._sessions)

    def mark_gone(self, session_id: str) -> None:
        """A dropped session: deleted from the catalog with the next write."""
        self.gone.add(session_id)
        self.dirty.discard(session_id)

    def share_sessions(self) -> None:
        """A shared tier is on: from now on, changed sessions are queued for publishing (``shared_batch``)."""
        self.publish_sessions = True

    def session_tokens(self, session: Session) -> np.ndarray | None:
        """The token ids of the session's full blocks: held in memory, else read from the catalog."""
        if session.token_ids is None and self.catalog is not None:
            from kvtier.persist.catalog import decode_tokens

            data = self.catalog.token_ids(session.session_id)
            if data is not None:
                session.token_ids = decode_tokens(data)
        return session.token_ids

    # ---- the shared store ---------------------------------------------------------------------
    def shared_batch(self, box: str | None = None) -> list[dict]:
        """Entries for the shared store of the sessions changed since the last call (call under the
        engine's lock): what another box needs to list and restore them. ``requeue_shared`` puts
        back the ids of a batch that could not be published."""
        dirty, self.shared_dirty = self.shared_dirty, set()
        entries = []
        for session_id in sorted(dirty):
            session = self._sessions.get(session_id)
            if session is None or not session.keys:
                continue
            tokens = self.session_tokens(session)
            if tokens is None or len(tokens) < len(session.keys) * self._geometry.block_tokens:
                continue  # without its token ids another box could not check its keys
            entries.append({"session_id": session_id, "namespace": session.namespace, "keys": list(session.keys),
                            "token_ids": tokens, "num_tokens": int(session.num_tokens),
                            "pinned": None if session.pinned is None else Tier(session.pinned).name.lower(),
                            "box": box, "last_use": float(session.last_use), "key_scheme": self._key_scheme})
        return entries

    def requeue_shared(self, session_ids: Iterable[str]) -> None:
        self.shared_dirty.update(session_ids)

    # ---- the catalog --------------------------------------------------------------------------
    def catalog_batch(self) -> tuple[list, list[str]]:
        """The catalog rows of the sessions changed since the last call (call under the engine's
        lock; the write itself, ``write_catalog``, needs no lock)."""
        from kvtier.persist.catalog import SessionRecord, encode_tokens

        dirty, gone = self.dirty, self.gone
        self.dirty, self.gone = set(), set()
        upserts = []
        for session_id in dirty:
            session = self._sessions.get(session_id)
            if session is None:
                continue
            blob, key_len = session.keys_blob()
            if not key_len:
                continue  # keys of mixed lengths: not a vLLM session; nothing to persist
            tokens = None
            if session.tokens_dirty and session.token_ids is not None:
                tokens = encode_tokens(session.token_ids)
                session.tokens_dirty = False
            upserts.append(SessionRecord(session_id, session.namespace, blob, key_len, int(session.num_tokens),
                                         None if session.pinned is None else int(session.pinned),
                                         float(session.created), float(session.last_use), tokens,
                                         session.pin_expires, session.retain_until, session.retain_priority))
        return upserts, sorted(gone - dirty)

    def write_catalog(self, batch: tuple[list, list[str]], lock=None) -> bool:
        """Write one ``catalog_batch`` (a failed write keeps its sessions for the next try). The
        write runs outside ``lock``; the bookkeeping after it inside."""
        upserts, deletes = batch
        if self.catalog is None or (not upserts and not deletes):
            return True
        try:
            self.catalog.write(upserts, deletes)
            error = None
        except Exception as exc:  # noqa: BLE001 - a full or failing disk must not stop serving
            error = exc
        with lock if lock is not None else contextlib.nullcontext():
            return self._written(upserts, deletes, error)

    def _written(self, upserts: list, deletes: list[str], exc: Exception | None) -> bool:
        if exc is not None:
            for record in upserts:
                self.dirty.add(record.session_id)
                session = self._sessions.get(record.session_id)
                if record.token_ids is not None and session is not None:
                    session.tokens_dirty = True
            self.gone.update(deletes)
            self._telemetry.warn("catalog", f"{_WRITE_FAILED} ({exc}); retrying")
            self._telemetry.count("catalog_write_failures")
            return False
        if (self._telemetry.warning("catalog") or "").startswith(_WRITE_FAILED):
            self._telemetry.warn("catalog", None)
        self._telemetry.count("catalog_writes")
        self._telemetry.count("catalog_rows_written", len(upserts))
        return True

    def sync_catalog(self, lock=None) -> bool:
        """Write the sessions that changed since the last call. ``lock``: the engine's lock, held
        only to copy them. Calls are serialized end to end, so a batch copied earlier is never
        written after one copied later (a pin must not be overwritten by the state before it)."""
        if self.catalog is None:
            return True
        with self._order:
            with lock if lock is not None else contextlib.nullcontext():
                batch = self.catalog_batch()
            return self.write_catalog(batch, lock)
