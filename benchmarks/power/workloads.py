"""The recorded runs crash states are cut from: kvtier's real code doing each kind of durable work
under the recorder, from a fresh directory.

Two worlds:
* ``store``: an ``NvmeStore`` alone, every block's payload a function of its key (``payload``):
  group commits, journal compaction, segment compaction, a wiped and recreated directory;
* ``engine``: a ``TierEngine`` (DRAM, NVMe, catalog, snapshots; ``benchmarks.faults.world``),
  blocks a function of their keys too: write-behind, demotion under pressure, catalog commits,
  snapshot writes. What the engine accepted into DRAM is marked ``stored`` (acknowledged to vLLM,
  durable only once written behind: the documented window).
"""
from __future__ import annotations

import contextlib
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from benchmarks.power.trace import Recorder
from kvtier.tiers import fileio

__all__ = ["WORKLOADS", "Recorded", "payload", "NAMESPACE", "FINGERPRINT", "STORE_RECORDS"]

NAMESPACE = b"\x11" * 16
FINGERPRINT = b"\x22" * 16
SIZES = (3000, 4096, 9000, 20000)  # payload bytes: records of 8 to 24 KiB, some with a partial page
STORE_RECORDS = 160  # the store's budget, in its largest records
SEGMENT = 1 << 20
ENGINE_NVME_BLOCKS = 200


@dataclass
class Recorded:
    name: str
    world: str  # "store" | "engine"
    trace: Recorder
    capacity: int = 0
    dram_blocks: int = 0
    nvme_blocks: int = 0
    tokens: dict[str, list[int]] = field(default_factory=dict)  # engine: each session's last tokens


def payload(key: bytes, nbytes: int) -> bytes:
    """The bytes a store workload writes for ``key`` (so any block read back can be checked)."""
    return random.Random(key).randbytes(nbytes)


def _capacity() -> int:
    from kvtier.tiers.records import file_bytes_for

    return STORE_RECORDS * file_bytes_for(max(SIZES))


def _store(root: Path):
    from kvtier.tiers.nvme.store import NvmeStore

    return NvmeStore(root / "nvme", _capacity(), io_threads=2, segment_bytes=SEGMENT)


def _batch(store, rng: random.Random, count: int) -> list[tuple[bytes, bytes]]:
    blocks = []
    for _ in range(count):
        key = rng.randbytes(32)
        blocks.append((NAMESPACE, key, payload(key, rng.choice(SIZES)), "none"))
    outcomes = store.write_batch(blocks, FINGERPRINT)
    return [(ns, key) for (ns, key, _p, _c), out in zip(blocks, outcomes) if not isinstance(out, BaseException)]


def _drop_some(store, rng: random.Random, written: list, share: float) -> None:
    gone = [name for name in written if rng.random() < share]
    store.delete_many(gone)
    written[:] = [name for name in written if name not in set(gone)]


# ---- the store's workloads ---------------------------------------------------------------------
def _group_commits(root: Path, rng: random.Random) -> None:
    store = _store(root)
    written: list = []
    for batch in range(14):
        written += _batch(store, rng, rng.randint(1, 12))
        if batch % 4 == 3:
            _drop_some(store, rng, written, 0.3)
    store.close()


def _journal_compaction(root: Path, rng: random.Random) -> None:
    from kvtier.tiers.nvme import journal

    slack, journal.REWRITE_SLACK = journal.REWRITE_SLACK, 24  # a small journal is rewritten at start
    try:
        store = _store(root)
        written: list = []
        for _ in range(8):
            written += _batch(store, rng, rng.randint(3, 8))
            _drop_some(store, rng, written, 0.6)
        store.close()
        store = _store(root)  # the restart rewrites the journal: temp file, sync, rename, directory sync
        for _ in range(3):
            written += _batch(store, rng, rng.randint(1, 6))
        store.close()
    finally:
        journal.REWRITE_SLACK = slack


def _segment_compaction(root: Path, rng: random.Random) -> None:
    store = _store(root)
    store.can_punch = False  # a filesystem without hole punching: compaction reclaims the space
    written: list = []
    while store.used_bytes < 3 * SEGMENT:
        written += _batch(store, rng, 10)
    _drop_some(store, rng, written, 0.75)
    store.compact(max_bytes=16 * SEGMENT, sparse=0.6)
    written += _batch(store, rng, 4)
    store.close()


def _wiped_directory(root: Path, rng: random.Random) -> None:
    store = _store(root)
    for _ in range(4):
        _batch(store, rng, rng.randint(2, 8))
    shutil.rmtree(root / "nvme")  # the operator wipes the tier's directory under the running server
    fileio.recorder().wiped(root / "nvme")
    store.check_present()  # made again, empty
    for _ in range(5):
        _batch(store, rng, rng.randint(2, 8))
    store.close()


# ---- the engine's workloads --------------------------------------------------------------------
def _world(root: Path, dram_blocks: int, nvme_blocks: int):
    from benchmarks.faults.world import World

    return World(root, dram_blocks=dram_blocks, nvme_blocks=nvme_blocks)


def _session(world, rng: random.Random, tokens: dict, sid: str | None = None) -> str:
    """A new session (or ``sid`` extended) stored into DRAM; marked ``stored``."""
    from benchmarks.faults.world import HBM_BLOCKS, SHAPE, _tokens
    from kvtier.plan.index import chain_block_hashes

    if sid is None:
        sid = f"s{len(tokens)}-{rng.randrange(1 << 20)}"
        ids = _tokens(rng.randrange(1 << 20), rng.randint(2, 8))
    else:
        ids = _tokens(rng.randrange(1 << 20), len(tokens[sid]) // SHAPE[3] + rng.randint(1, 3), tokens[sid])
    keys = chain_block_hashes(ids, SHAPE[3])[:HBM_BLOCKS]
    world.put(keys, range(len(keys)))
    world.engine.store(sid, world.ns, keys, list(range(len(keys))), num_tokens=len(keys) * SHAPE[3],
                       token_ids=ids[: len(keys) * SHAPE[3]])
    tokens[sid] = ids[: len(keys) * SHAPE[3]]
    fileio.acknowledge("stored", *keys)
    return sid


def _write_behind(world, rng: random.Random, tokens: dict) -> None:
    for turn in range(10):
        _session(world, rng, tokens, rng.choice(list(tokens)) if tokens and turn % 3 == 2 else None)
        if turn % 2 == 1:
            world.engine.write_behind(0.0)


def _demotion(world, rng: random.Random, tokens: dict) -> None:
    from kvtier.plan.index import Tier

    for turn in range(12):
        _session(world, rng, tokens)
        world.engine.maintain(force=True)  # over the high watermark: the coldest sessions go to NVMe
        if turn % 4 == 3:
            with contextlib.suppress(Exception):
                world.engine.evict(rng.choice(list(tokens)), Tier.NVME)


def _catalog_commits(world, rng: random.Random, tokens: dict) -> None:
    from kvtier.plan.index import Tier

    for turn in range(14):
        sid = _session(world, rng, tokens, rng.choice(list(tokens)) if tokens and turn % 3 == 1 else None)
        action = turn % 4
        with contextlib.suppress(Exception):  # a pin refused for room, a session already gone: not the subject
            if action == 0:
                world.engine.evict(sid, Tier.NVME)  # each operator action commits the catalog
            elif action == 1:
                world.engine.pin(sid, Tier.NVME)
            elif action == 2:
                world.engine.unpin(rng.choice(list(tokens)))
            else:
                gone = rng.choice(list(tokens))
                world.engine.evict(gone, None)  # dropped; its tokens stay the truth of any entry left


def _snapshot_writes(world, rng: random.Random, tokens: dict) -> None:
    for turn in range(6):
        sid = _session(world, rng, tokens)
        world.engine.snapshot(sid, world.snapshots / f"{sid}.kvsnap")
        if turn == 3:
            world.engine.restore(sorted(world.snapshots.glob("*.kvsnap"))[0])


def _engine(fn: Callable, dram: int) -> Callable:
    def run(root: Path, rng: random.Random, recorded: Recorded) -> None:
        recorded.world, recorded.dram_blocks, recorded.nvme_blocks = "engine", dram, ENGINE_NVME_BLOCKS
        world = _world(root, dram, ENGINE_NVME_BLOCKS)
        try:
            fn(world, rng, recorded.tokens)
        finally:
            world.close()
    return run


def _plain(fn: Callable) -> Callable:
    def run(root: Path, rng: random.Random, recorded: Recorded) -> None:
        recorded.world, recorded.capacity = "store", _capacity()
        fn(root, rng)
    return run


WORKLOADS: dict[str, Callable[[Path, random.Random, Recorded], None]] = {
    "group_commit": _plain(_group_commits),
    "write_behind": _engine(_write_behind, 48),
    "demotion": _engine(_demotion, 10),
    "journal_compaction": _plain(_journal_compaction),
    "segment_compaction": _plain(_segment_compaction),
    "catalog_commit": _engine(_catalog_commits, 24),
    "snapshot_write": _engine(_snapshot_writes, 32),
    "wiped_directory": _plain(_wiped_directory),
}


def record(name: str, root: Path, seed: int) -> Recorded:
    """Run workload ``name`` in the empty directory ``root`` under a recorder."""
    (root / "snapshots").mkdir(parents=True, exist_ok=True)  # the operator's directory, there before
    recorder = Recorder(root)
    recorded = Recorded(name, "", recorder)
    with recorder:
        WORKLOADS[name](root, random.Random(seed), recorded)
    return recorded
