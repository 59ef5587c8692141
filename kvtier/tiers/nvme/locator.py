"""The locator: which extent holds each block (``(namespace, key) -> Extent``) and the index journal
that makes that map durable.

Owns the map, the journal (``journal.py``) and the order of commits: journal appends are applied
to the map in the order they were made (one commit lock), so a replay rebuilds the same map.
Segment ids <= 0 are old-layout block files: served, never journaled."""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterable, Iterator

from kvtier.tiers.nvme.journal import Extent, Journal
from kvtier.tiers.nvme.parts import Name, log
from kvtier.tiers.records import file_bytes_for

__all__ = ["Locator"]


class Locator:
    """The key -> extent map of one shard, loaded from ``extents`` (what start-up recovered), kept
    durable in ``journal``."""

    def __init__(self, journal: Journal, extents: dict[Name, Extent]):
        self.journal = journal
        self._map = extents
        self._lock = threading.Lock()  # the map
        self._commit_lock = threading.Lock()  # journal appends, applied to the map in the same order

    # ---- lookups (no IO) ------------------------------------------------------------------
    def get(self, name: Name) -> Extent | None:
        return self._map.get(name)

    def __getitem__(self, name: Name) -> Extent:
        return self._map[name]

    def __contains__(self, name: object) -> bool:
        return name in self._map

    def __len__(self) -> int:
        return len(self._map)

    def snapshot(self) -> dict[Name, Extent]:
        with self._lock:
            return dict(self._map)

    def lookup_all(self, names: Iterable[Name]) -> list[Extent | None]:
        with self._lock:
            return [self._map.get(name) for name in names]

    def ends(self) -> dict[int, int]:
        """Per segment, the end of its last named record."""
        ends: dict[int, int] = {}
        with self._lock:
            for ext in self._map.values():
                ends[ext.segment] = max(ends.get(ext.segment, 0), ext.offset + file_bytes_for(ext.nbytes))
        return ends

    def pick(self, segments: set[int], budget: int) -> list[tuple[Name, Extent]]:
        """Blocks held by ``segments``, up to about ``budget`` bytes of records (compaction's choice)."""
        picked = []
        with self._lock:
            for name, ext in self._map.items():
                if budget <= 0:
                    break
                if ext.segment in segments:
                    picked.append((name, ext))
                    budget -= file_bytes_for(ext.nbytes)
        return picked

    # ---- changes --------------------------------------------------------------------------
    def put(self, entries: list[tuple[Name, Extent]], expected: dict[Name, Extent] | None = None,
            named: Callable[[list[Extent]], None] | None = None) -> tuple[list[int], list[Extent]]:
        """Name durable records: one journal append, then the map. With ``expected`` (compaction's
        moves), a block whose extent changed meanwhile is left as it is. ``named`` sees the extents
        put, in commit order. Returns the indices of ``entries`` put and the extents they replaced."""
        with self._commit_lock:
            keep = list(range(len(entries)))
            if expected is not None:
                with self._lock:
                    keep = [k for k in keep if self._map.get(entries[k][0]) == expected[entries[k][0]]]
            chosen = [entries[k] for k in keep]
            self.journal.append([(ns, key, ext) for (ns, key), ext in chosen])
            replaced: list[Extent] = []
            with self._lock:
                for name, ext in chosen:
                    old = self._map.get(name)
                    self._map[name] = ext
                    if old is not None:
                        replaced.append(old)
            if named is not None:
                named([ext for _name, ext in chosen])
        return keep, replaced

    def drop(self, names: Iterable[Name]) -> list[Extent]:
        """Forget blocks (one journal append for all); returns the extents they had."""
        with self._commit_lock:
            with self._lock:
                gone = [(name, self._map[name]) for name in dict.fromkeys(names) if name in self._map]
            if not gone:
                return []
            try:
                self.journal.append([], [name for name, ext in gone if ext.segment > 0])
            except OSError as exc:  # a full disk must still free its own space: the start-up check
                # drops entries that name punched-out ranges
                log.warning("NVMe tier: dropping %d blocks was not journaled (%s)", len(gone), exc)
            with self._lock:
                for name, _ext in gone:
                    self._map.pop(name, None)
        return [ext for _name, ext in gone]

    def journaled(self) -> dict[Name, Extent]:
        """The entries the journal holds (old-layout block files are not journaled)."""
        with self._lock:
            return {n: e for n, e in self._map.items() if e.segment > 0}

    def rewrite_if_lost(self) -> None:
        """Write the journal again from memory when its file is gone and blocks are known."""
        if self._map and not self.journal.exists():
            with contextlib.suppress(OSError), self._commit_lock:
                self.journal.rewrite(self.journaled())

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No commit or drop runs meanwhile (the directory is being made again)."""
        with self._commit_lock:
            yield

    def clear(self) -> None:
        """Forget every block (inside ``exclusive``); the journal is rewritten empty where it can be."""
        with self._lock:
            self._map.clear()
        with contextlib.suppress(OSError):
            self.journal.rewrite({})
