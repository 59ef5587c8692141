"""The session catalog and the shared tier's session entries, for ``TierManager``: which sessions
changed since the last write, their rows for SQLite, their entries for the shared store, and the
bookkeeping after a write. A mixin of ``TierManager``; the writes themselves run outside the engine's
lock."""
from __future__ import annotations

import contextlib
import gc
import time
from typing import TYPE_CHECKING, Iterable

import numpy as np

from kvtier.plan.index import (
    Tier,
)

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.persist.catalog import Catalog
    from kvtier.plan.manager import TierManager

__all__ = ["CatalogSync"]


class CatalogSync:
    # ---- the session catalog ------------------------------------------------------------------
    def _read_catalog(self: "TierManager", catalog: "Catalog") -> None:
        """Sessions of an earlier run: listed at once (cold where their blocks are on NVMe), pins kept."""
        started = time.perf_counter()
        collecting = gc.isenabled()
        gc.disable()  # hundreds of thousands of acyclic objects: the cyclic collector would rescan them
        try:
            self.sessions.update((session.session_id, session) for session in catalog.load())
        finally:
            if collecting:
                gc.enable()
        pin = self.index.col["pin"]
        for session in self.sessions.values():  # a block takes the hottest pin of the sessions holding it
            if session.pinned is not None:
                rows = self.session_row_array(session)
                pin[rows] = np.where(pin[rows] == 0, session.pinned, np.minimum(pin[rows], session.pinned))
        for message in catalog.warnings:
            self.warnings["catalog"] = message
        self.counters["catalog_sessions_at_start"] = len(self.sessions)
        self.counters["catalog_start_ms"] = int((time.perf_counter() - started) * 1000)

    def _mark_changed(self: "TierManager", session_id: str) -> None:
        self._catalog_dirty.add(session_id)
        if self.publish_sessions:
            self._shared_dirty.add(session_id)

    def shared_batch(self: "TierManager", box: str | None = None) -> list[dict]:
        """Entries for the shared store of the sessions changed since the last call (call under the
        engine's lock): what another box needs to list and restore them. ``requeue_shared`` puts
        back the ids of a batch that could not be published."""
        dirty, self._shared_dirty = self._shared_dirty, set()
        entries = []
        for session_id in sorted(dirty):
            session = self.sessions.get(session_id)
            if session is None or not session.keys:
                continue
            tokens = self.session_tokens(session)
            if tokens is None or len(tokens) < len(session.keys) * self.geometry.block_tokens:
                continue  # without its token ids another box could not check its keys
            entries.append({"session_id": session_id, "namespace": session.namespace, "keys": list(session.keys),
                            "token_ids": tokens, "num_tokens": int(session.num_tokens),
                            "pinned": None if session.pinned is None else Tier(session.pinned).name.lower(),
                            "box": box, "last_use": float(session.last_use), "key_scheme": self.key_scheme})
        return entries

    def requeue_shared(self: "TierManager", session_ids: Iterable[str]) -> None:
        self._shared_dirty.update(session_ids)

    def catalog_batch(self: "TierManager") -> tuple[list, list[str]]:
        """The catalog rows of the sessions changed since the last call (call under the engine's
        lock; the write itself, ``write_catalog``, needs no lock)."""
        from kvtier.persist.catalog import SessionRecord, encode_tokens

        dirty, gone = self._catalog_dirty, self._catalog_gone
        self._catalog_dirty, self._catalog_gone = set(), set()
        upserts = []
        for session_id in dirty:
            session = self.sessions.get(session_id)
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
                                         float(session.created), float(session.last_use), tokens))
        return upserts, sorted(gone - dirty)

    def write_catalog(self: "TierManager", batch: tuple[list, list[str]], lock=None) -> bool:
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
            return self._catalog_written(upserts, deletes, error)

    def _catalog_written(self: "TierManager", upserts: list, deletes: list[str], exc: Exception | None) -> bool:
        if exc is not None:
            for record in upserts:
                self._catalog_dirty.add(record.session_id)
                session = self.sessions.get(record.session_id)
                if record.token_ids is not None and session is not None:
                    session.tokens_dirty = True
            self._catalog_gone.update(deletes)
            self.warnings["catalog"] = f"the session catalog could not be written ({exc}); retrying"
            self.counters["catalog_write_failures"] += 1
            return False
        if self.warnings.get("catalog", "").startswith("the session catalog could not be written"):
            del self.warnings["catalog"]
        self.counters["catalog_writes"] += 1
        self.counters["catalog_rows_written"] += len(upserts)
        return True

    def sync_catalog(self: "TierManager", lock=None) -> bool:
        """Write the sessions that changed since the last call. ``lock``: the engine's lock, held
        only to copy them. Calls are serialized end to end, so a batch copied earlier is never
        written after one copied later (a pin must not be overwritten by the state before it)."""
        if self.catalog is None:
            return True
        with self._catalog_order:
            with lock if lock is not None else contextlib.nullcontext():
                batch = self.catalog_batch()
            return self.write_catalog(batch, lock)

