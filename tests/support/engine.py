"""Engines on real disks, and the disk faults tests put under them.

``make_engine``: a whole tier engine (manager and mover) over CPU-layout 'HBM' tensors, with a
DRAM arena and an NVMe directory under the test's ``tmp_path``. ``break_disk`` / ``heal_disk``: a
real filesystem fault (the NVMe tier's journal replaced by a directory). ``records_on_disk``: where
every block an NVMe directory holds lies, read-only.
"""
from __future__ import annotations

__all__ = ["make_engine", "records_on_disk", "break_disk", "heal_disk"]


def make_engine(fingerprint, hbm, tmp_path, dram_blocks=8, nvme_blocks=64, policy="lru", **kwargs):
    from kvtier.engine import TierEngine
    from kvtier.tiers.nvme.store import file_bytes_for

    block = fingerprint.geometry.block_bytes
    nvme_bytes = nvme_blocks * file_bytes_for(block)
    return TierEngine(fingerprint, dram_blocks * block, tmp_path / "nvme" if nvme_blocks else None, nvme_bytes,
                      policy, kv_layers=hbm, **kwargs)


def records_on_disk(nvme_dir) -> list:
    """(segment file, offset, record bytes) of every block an NVMe directory holds, in disk order
    (read-only: works beside a running server)."""
    from kvtier.tiers.nvme.store import NvmeStore

    store = NvmeStore(nvme_dir, 1 << 40, io_threads=1, readonly=True)
    try:
        return sorted(store.locate(r.namespace, r.key) for r in store.scan())
    finally:
        store.close()


def break_disk(nvme):
    """A real filesystem fault that fails every commit and keeps every record: the tier's index
    journal moved aside and a directory put in its place (appends fail with EISDIR)."""
    from kvtier.tiers.nvme.journal import JOURNAL_NAME

    (nvme / JOURNAL_NAME).rename(nvme / "journal.aside")
    (nvme / JOURNAL_NAME).mkdir()


def heal_disk(nvme):
    from kvtier.tiers.nvme.journal import JOURNAL_NAME

    (nvme / JOURNAL_NAME).rmdir()
    (nvme / "journal.aside").rename(nvme / JOURNAL_NAME)
