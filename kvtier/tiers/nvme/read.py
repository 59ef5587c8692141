"""The read path: a batch's extents sorted, adjacent records merged into preadv calls of up to
8 MiB, several in flight, each record verified before its bytes count (``IoEngine.read_run``).

``SegmentReader`` owns no state of its own: it looks blocks up in the locator, their files in the
segment space, and has the IO engine read them; a damaged record is dropped through ``drop``."""
from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Sequence

from kvtier.errors import CorruptBlockError, StorageError
from kvtier.tiers.dram import round_up
from kvtier.tiers.nvme.ioengine import IoEngine
from kvtier.tiers.nvme.locator import Locator
from kvtier.tiers.nvme.parts import Name, _Item, _runs, storage_error
from kvtier.tiers.nvme.space import SegmentSpace
from kvtier.tiers.records import StorageViews

__all__ = ["SegmentReader"]


class SegmentReader:
    """Verified batched reads of the blocks ``locator`` names in ``space``'s files under ``root``."""

    def __init__(self, root: Path, space: SegmentSpace, locator: Locator, engine: IoEngine,
                 drop: Callable[[list[Name]], int]):
        self._root = root
        self._space = space
        self._locator = locator
        self._engine = engine
        self._drop = drop

    def read_into(self, namespace: bytes, key: bytes, dst: Any, fingerprint: bytes) -> tuple[int, str]:
        """Read and verify one block into ``dst`` (uint8, contiguous); returns (nbytes, codec)."""
        (outcome,) = self.read_batch([(namespace, key, dst)], fingerprint)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def submit_read(self, *args: Any, **kwargs: Any) -> Future:
        return self._engine.spawn(self.read_into, *args, **kwargs)

    def read_batch(self, reads: Sequence[tuple[bytes, bytes, Any]], fingerprint: bytes,
                   retry: bool = True) -> list[tuple[int, str] | BaseException]:
        """Read and verify ``(namespace, key, destination)`` blocks: adjacent records merged into large
        reads, several in flight. Returns, per block, (nbytes, codec) or the exception (a block that
        is not stored, a damaged one: dropped). Not for the store's own IO threads."""
        outcomes: list[tuple[int, str] | BaseException] = [(0, "")] * len(reads)
        items = []
        extents = self._locator.lookup_all((namespace, key) for namespace, key, _dst in reads)
        for i, ((namespace, key, dst), ext) in enumerate(zip(reads, extents)):
            if ext is None:
                outcomes[i] = StorageError(f"NVMe tier: block {key.hex()[:16]} is not stored")
            else:
                items.append(_Item(i, namespace, key, dst, ext))
        self._prepare(items)
        items.sort(key=lambda item: (item.extent.segment, item.extent.offset))
        ios = list(_runs(items))
        for io, result in zip(ios, self._engine.run(lambda io: self._read_run(io, fingerprint), ios)):
            for item, outcome in zip(io, result if isinstance(result, list) else [result] * len(io)):
                outcomes[item.index] = storage_error(outcome, "reading a block", self._root) \
                    if isinstance(outcome, OSError) else outcome
        bad = [item for item in items if isinstance(outcomes[item.index], CorruptBlockError)]
        moved = [item for item in bad if self._locator.get(item.name) not in (None, item.extent)]
        if moved and retry:  # rewritten or compacted while we read: read the new copy
            again = self.read_batch([reads[item.index] for item in moved], fingerprint, retry=False)
            for item, outcome in zip(moved, again):
                outcomes[item.index] = outcome
        stale = [item.name for item in bad if self._locator.get(item.name) == item.extent]
        if stale:
            self._drop(stale)
        return outcomes

    def _prepare(self, items: list[_Item]) -> None:
        views = StorageViews()
        direct = self._engine.direct
        for item in items:
            # read in place only into a page-aligned destination that owns the padded length itself,
            # so the padding never spills into a neighbour's bytes
            padded = round_up(item.extent.nbytes)
            item.data, window = views.both(item.buffer, padded if direct else None)
            if window is not None and len(item.data) >= padded:
                item.window = window

    def _read_run(self, io: list[_Item], fingerprint: bytes) -> list:
        where = self._space.path_or_none(io[0].extent.segment) or self._space.seg_dir
        return self._engine.read_run(where, io, fingerprint)
