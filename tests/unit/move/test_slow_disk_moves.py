"""A slow disk and the mover: NVMe reads report their bytes and time (the cost model's live view of
the disk), and NVMe writes (demotions, flushes, drops) run on a thread of their own, so a disk that
holds a write never queues a load behind it. A held thread stands in for the slow disk: no sleeps,
no timing asserts."""
from __future__ import annotations

import threading

import torch

from kvtier.engine import TierEngine
from kvtier.jobs import JobKind
from kvtier.layout import KVGeometry, ModelFingerprint
from kvtier.move.runner import DISK_WRITES
from kvtier.plan.index import Tier, chain_block_hashes, namespace_of

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=16, dtype="bfloat16")
TOKENS = list(range(2000, 2064))
KEYS = chain_block_hashes(TOKENS, 16)


def make_engine(tmp_path) -> tuple[TierEngine, list[torch.Tensor], bytes]:
    g = torch.Generator().manual_seed(3)
    layers = [torch.randn(8, 1, 16, 16, generator=g).to(torch.bfloat16) for _ in range(GEOMETRY.num_layers)]
    eng = TierEngine(ModelFingerprint("tiny", GEOMETRY), 1 << 20, tmp_path / "nvme", 1 << 24, kv_layers=layers,
                     catalog=False)
    ns = namespace_of(eng.fingerprint.digest)
    assert eng.store("s", ns, KEYS, [0, 1, 2, 3], num_tokens=64) == 4
    return eng, layers, ns


def test_an_nvme_load_reports_what_it_read_and_how_long_it_took(tmp_path):
    eng, _layers, ns = make_engine(tmp_path)
    eng.evict("s", Tier.NVME)
    job = eng.manager.prepare_load(eng.manager.table.lookup(ns, KEYS), [4, 5, 6, 7])
    assert job is not None and all(move.from_nvme for move in job.moves)
    result = eng.execute(job)
    assert result.ok and result.nvme_read_s > 0
    assert result.nvme_read_bytes == sum(move.nbytes for move in job.moves) > 0
    again = eng.execute(eng.manager.prepare_load(eng.manager.table.lookup(ns, KEYS), [4, 5, 6, 7]))
    assert again.ok and again.nvme_read_bytes == 0 and again.nvme_read_s == 0  # from DRAM now: no disk read
    eng.close(write_back=False)


def test_held_disk_writes_never_queue_a_load(tmp_path):
    """Two demotions stuck on the disk (as many as the mover has pool threads) and a load after them:
    the load still runs."""
    eng, layers, ns = make_engine(tmp_path)
    other = chain_block_hashes(list(range(5000, 5064)), 16)
    assert eng.store("t", ns, other, [4, 5, 6, 7], num_tokens=64) == 4
    hold, entered = threading.Event(), threading.Semaphore(0)
    real_write = eng.nvme.write_batch

    def stuck_write(*args, **kwargs):  # the disk takes a write and does not come back until `hold`
        entered.release()
        assert hold.wait(60)
        return real_write(*args, **kwargs)

    eng.nvme.write_batch = stuck_write
    try:
        writes = [eng.manager.pressure.flush(session) for session in ("s", "t")]
        assert all(job is not None and job.kind in DISK_WRITES for job in writes)
        writing = [eng.mover.jobs.submit(job) for job in writes]
        assert entered.acquire(timeout=60)  # the first write is on the disk
        load = eng.manager.prepare_load(eng.manager.table.lookup(ns, KEYS), [4, 5, 6, 7])
        assert load is not None and load.kind == JobKind.LOAD
        eng.mover.jobs.submit(load).result(timeout=60)  # ran although the disk holds every write
        assert not any(future.done() for future in writing)
    finally:
        hold.set()
    for future in writing:
        future.result(timeout=60)
    for result in eng.mover.jobs.poll():
        assert result.ok
        eng.manager.complete(result)
    out, ref = (torch.empty((4, *GEOMETRY.block_shape), dtype=torch.bfloat16) for _ in range(2))
    eng.mover.copies.adapter.gather(layers, [4, 5, 6, 7], out)
    eng.mover.copies.adapter.gather(layers, [0, 1, 2, 3], ref)
    assert torch.equal(out, ref)
    eng.close(write_back=False)


def test_a_restore_that_writes_the_disk_waits_behind_a_drop_planned_before_it(tmp_path):
    """Jobs that write or delete NVMe records by name run in order on the disk thread: a restore of
    a key to NVMe (or any job with drops) never overtakes a drop of that key held up by the disk."""
    from kvtier.jobs import BlockMove, Job
    from kvtier.move.runner import writes_disk

    move = BlockMove(0, b"\1" * 16, b"k", dram_slot=0)
    assert writes_disk(Job(1, JobKind.DROP)) and writes_disk(Job(2, JobKind.DEMOTE))
    assert writes_disk(Job(3, JobKind.RESTORE, moves=[BlockMove(0, b"\1" * 16, b"k", to_nvme=True)]))
    assert writes_disk(Job(4, JobKind.FETCH, drops=[move]))
    assert not writes_disk(Job(5, JobKind.RESTORE, moves=[move]))  # into DRAM only: not behind the disk
    assert not writes_disk(Job(6, JobKind.LOAD, moves=[move]))
