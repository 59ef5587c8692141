"""The write path: a batch's records placed back to back in the open segment (ranges fallocate-d),
written with one pwritev of header and payload iovecs per ~8 MiB (O_DIRECT, no bounce copy), one
fdatasync per segment and one journal append for the batch (group commit); dropped records
forgotten and their space given back.

``SegmentWriter`` owns no state of its own: it drives the segment space (reservations, places,
live bytes), the locator (the commit) and the IO engine, which it is given."""
from __future__ import annotations

import errno
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from kvtier.errors import CapacityError
from kvtier.tiers import fileio
from kvtier.tiers.dram import round_up
from kvtier.tiers.nvme.ioengine import IoEngine, captured
from kvtier.tiers.nvme.journal import Extent
from kvtier.tiers.nvme.locator import Locator
from kvtier.tiers.nvme.parts import Name, _chunks, _Item, _nbytes, _runs, storage_error
from kvtier.tiers.nvme.space import SegmentSpace
from kvtier.tiers.records import StorageViews

__all__ = ["SegmentWriter"]


class SegmentWriter:
    """Durable group-committed writes and drops into ``space``, named by ``locator``, done by
    ``engine``. ``recreate``: make the shard directory again if it vanished (True if it had);
    a batch that found its files gone is written once more after it."""

    def __init__(self, root: Path, space: SegmentSpace, locator: Locator, engine: IoEngine,
                 recreate: Callable[[], bool]):
        self._root = root
        self._space = space
        self._locator = locator
        self._engine = engine
        self._recreate = recreate

    # ---- write ------------------------------------------------------------------------------
    def write(self, namespace: bytes, key: bytes, payload: Any, fingerprint: bytes, codec: str = "none") -> int:
        """Store one block durably; returns its record's size. Raises StorageFullError on ENOSPC."""
        (outcome,) = self.write_batch([(namespace, key, payload, codec)], fingerprint)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def submit_write(self, *args: Any, **kwargs: Any) -> Future:
        """``write`` on an IO thread (one block: its IO runs on that thread, nothing nested)."""
        return self._engine.spawn(self.write, *args, **kwargs)

    def write_batch(self, blocks: Sequence[tuple[bytes, bytes, Any, str]],
                    fingerprint: bytes) -> list[int | BaseException]:
        """Store ``(namespace, key, payload, codec)`` blocks durably, as one group commit. Returns,
        per block, its record's size on disk or the exception that kept it out (the budget, a full,
        read-only or missing disk). Durable when this returns. Not for the store's own IO threads."""
        if len(fingerprint) != 16:
            raise ValueError("NVMe tier: the fingerprint is 16 bytes")
        if any(len(key) > 64 or len(namespace) != 16 for namespace, key, _p, _c in blocks):
            raise ValueError("NVMe tier: namespace and fingerprint are 16 bytes, keys at most 64")
        outcomes: list[int | BaseException] = [0] * len(blocks)
        items = [_Item(i, namespace, key, payload, Extent(0, 0, _nbytes(payload), codec))
                 for i, (namespace, key, payload, codec) in enumerate(blocks)]
        try:
            self._space.reserve(sum(item.record_bytes for item in items))
        except CapacityError:  # not all of it fits: block by block, in order
            items = self._reserve_each(items, outcomes)
        if items:
            self._write_items(items, fingerprint, outcomes, StorageViews())
        fileio.acknowledge("blocks", *[(ns, key) for (ns, key, _p, _c), out in zip(blocks, outcomes)
                                       if not isinstance(out, BaseException)])
        return outcomes

    def _reserve_each(self, items: list[_Item], outcomes: list) -> list[_Item]:
        kept = []
        for item in items:
            try:
                self._space.reserve(item.record_bytes)
            except CapacityError as exc:
                outcomes[item.index] = exc
                continue
            kept.append(item)
        return kept

    def _write_items(self, items: list[_Item], fingerprint: bytes, outcomes: list, views: StorageViews,
                     retry: bool = True) -> None:
        """Place, write, sync, commit; a batch whose files vanished is written again once."""
        launched = self._launch(items, fingerprint, views)
        failed: list[_Item] = []
        good: dict[int, list[_Item]] = {}
        error: BaseException | None = None
        for run, future in launched:
            result = future if isinstance(future, BaseException) else future.result()
            if isinstance(result, BaseException):
                failed += run
                error = result
            else:
                good.setdefault(run[0].extent.segment, []).extend(run)
        for seg_id in list(good):  # group commit: one fdatasync per segment
            try:
                self._engine.sync(self._space.path(seg_id))
            except OSError as exc:
                failed += good.pop(seg_id)
                error = exc
        committed = [item for done in good.values() for item in done]
        try:
            self.commit(committed)
        except OSError as exc:
            failed += committed
            error, committed = exc, []
        for item in committed:
            outcomes[item.index] = item.record_bytes
        if failed:
            self._space.unplace(failed)
            if isinstance(error, FileNotFoundError) and retry and self._recreate():
                return self._write_items(failed, fingerprint, outcomes, views, retry=False)
            self.fail(failed, error or OSError(errno.EIO, "write failed"), outcomes)

    def _launch(self, items: list[_Item], fingerprint: bytes,
                views: StorageViews) -> list[tuple[list[_Item], Future | BaseException]]:
        """Streamed: each IO's worth of records is placed and handed to the IO threads as soon as
        it is ready, so the disk works while the rest is prepared."""
        launched: list[tuple[list[_Item], Future | BaseException]] = []
        for chunk in _chunks(items):
            direct = self._engine.direct
            for item in chunk:  # written from where it lies when it is page-aligned (O_DIRECT)
                item.data, item.window = views.both(item.buffer, round_up(item.extent.nbytes) if direct else None)
            try:
                self._space.place(chunk, allocate_now=False)  # each run allocates its range on its IO thread
            except OSError as exc:
                launched.append((chunk, exc))
                continue
            for run in _runs(chunk):
                launched.append((run, self._engine.submit(captured, self._write_run, run, fingerprint)))
        return launched

    def _write_run(self, run: list[_Item], fingerprint: bytes) -> None:
        self._engine.write_run(self._space.path(run[0].extent.segment), run, fingerprint)

    def fail(self, items: list[_Item], exc: BaseException, outcomes: list) -> None:
        """Items that did not make it (unplaced again): their reservation back, the error reported."""
        error = storage_error(exc, "writing a block", self._root)
        for item in items:
            self._space.release(item.record_bytes)
            outcomes[item.index] = error

    def commit(self, items: list[_Item], expected: dict[Name, Extent] | None = None) -> list[_Item]:
        """Name durable records in the journal, then in the map; give back what they replace. With
        ``expected`` (compaction's moves), a block whose extent changed meanwhile is left as it is;
        returns the items committed."""
        if not items:
            return []
        self._space.sync_dir()  # a new segment's name is durable before the journal names it
        self._engine.count("commits")
        kept, replaced = self._locator.put([(item.name, item.extent) for item in items], expected,
                                           named=self._space.committed)
        self._space.forget(replaced)
        return [items[k] for k in kept]

    # ---- drop -------------------------------------------------------------------------------
    def delete(self, namespace: bytes, key: bytes) -> int:
        """Remove a block; returns the bytes freed (0 when it was not stored)."""
        return self.delete_many([(namespace, key)])

    def delete_many(self, names: Iterable[Name]) -> int:
        """Remove blocks (one journal append for all); returns the bytes freed."""
        names = list(names)
        fileio.acknowledge("blocks_dropping", *names)  # from here a power cut may or may not keep them
        return self._space.forget(self._locator.drop(names))

