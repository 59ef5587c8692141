"""Sessions survive restarts: the session catalog, durable pins, write-behind, flush, weights identity.

Scripted scenarios on a real TierEngine (manager + mover + DRAM arena + NVMe files + SQLite catalog
on disk). A "restart" closes the engine without its shutdown write-back (as when vLLM kills its
worker) and opens a new one on the same directory; a "crash" is the same, minus even the catalog's
final write (the catalog is then whatever its last batch wrote).
"""
from __future__ import annotations

import json
import os
import sqlite3
import struct

import numpy as np
import pytest
import torch
from support.clock import FakeClock
from support.engine import break_disk, heal_disk, make_engine

from kvtier.jobs import JobKind
from kvtier.layout import ModelFingerprint
from kvtier.persist.catalog import Catalog, CatalogLockedError, held_locks
from kvtier.plan.index import IN_DRAM, IN_NVME, Tier, chain_block_hashes, namespace_of

BT = 16  # tokens per block in the test geometry


def tokens_of(seed: int, blocks: int) -> list[int]:
    return list(range(seed * 10_000, seed * 10_000 + blocks * BT))


def store(engine, session_id: str, seed: int, blocks: int, first_hbm: int = 0) -> list[bytes]:
    tokens = tokens_of(seed, blocks)
    keys = chain_block_hashes(tokens, BT)
    ns = namespace_of(engine.fingerprint.digest)
    engine.manager.planner.record_session(session_id, ns, keys, len(tokens), token_ids=tokens)
    engine.store(session_id, ns, keys, list(range(first_hbm, first_hbm + blocks)), len(tokens))
    return keys


def restart(engine, fingerprint, hbm, tmp_path, **kwargs):
    """Stop without the shutdown write-back (vLLM may kill the worker first), start a new engine."""
    engine.close(write_back=False)
    return make_engine(fingerprint, hbm, tmp_path, **kwargs)


def disk_clock(engine) -> FakeClock:
    """Put the manager's NVMe write back-off on a clock the test moves (no sleeping through it)."""
    clock = FakeClock()
    engine.manager.nvme_health.clock = clock
    return clock


def loads(engine, keys, first_hbm: int = 40) -> int:
    ns = namespace_of(engine.fingerprint.digest)
    return engine.load(ns, keys, list(range(first_hbm, first_hbm + len(keys))))


def states(engine) -> dict[str, str]:
    return {row["session_id"]: row["state"] for row in engine.manager.views.sessions_overview()}


# ---- the catalog across a restart ---------------------------------------------------------------
def test_sessions_pins_and_tokens_survive_a_restart(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    pinned = store(engine, "pinned", 1, 4, 0)
    warm = store(engine, "warm", 2, 4, 4)
    cold = store(engine, "cold", 3, 4, 8)
    engine.pin("pinned", Tier.NVME)  # durable: its blocks are written through at once
    engine.evict("cold", Tier.NVME)
    reference = [layer.clone() for layer in hbm]
    engine = restart(engine, fingerprint, hbm, tmp_path, dram_blocks=32)

    # 1. every session is listed at once, with its pin; the DRAM-only one lost its blocks (no
    #    write-behind ran) and says so instead of pretending
    assert states(engine) == {"pinned": "pinned", "warm": "gone", "cold": "cold"}
    info = {row["session_id"]: row for row in engine.manager.views.sessions_overview()}
    assert info["pinned"]["pinned"] == "nvme" and info["pinned"]["blocks_nvme"] == 4
    assert info["warm"]["blocks_missing"] == 4 and info["cold"]["blocks_missing"] == 0
    # 2. the pin still protects the blocks: they are never dropped
    rows = engine.manager.table.session_rows(engine.manager.table.session("pinned"))
    assert set(engine.manager.table.index.col["pin"][rows].tolist()) == {Tier.NVME}
    # 3. the next turns load, bit for bit
    assert loads(engine, pinned) == 4 and loads(engine, cold, 50) == 4 and loads(engine, warm) == 0
    assert all(torch.equal(layer[40:44], ref[0:4]) for layer, ref in zip(hbm, reference))
    # 4. a cold session's token ids come back from the catalog for a snapshot
    result = engine.snapshot("cold", tmp_path / "cold.kvsnap")
    from kvtier.persist.snapshot import open_snapshot

    assert result.ok and list(open_snapshot(tmp_path / "cold.kvsnap").token_ids) == tokens_of(3, 4)
    engine.close()


def test_write_behind_makes_dram_blocks_survive_a_crash(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    keys = store(engine, "agent", 1, 6)
    # 1. fresh blocks are dirty; a 10 s window writes none of them yet
    dirty = engine.manager.views.dirty_stats()
    assert dirty["dirty_blocks"] == 6 and dirty["dirty_bytes"] == 6 * fingerprint.geometry.block_bytes
    assert engine.write_behind(max_age_s=10) == 0
    # 2. once due, they get an NVMe copy and stay in DRAM (a load still comes from DRAM)
    assert engine.write_behind(max_age_s=0) == 6
    ns = namespace_of(fingerprint.digest)
    rows = [engine.manager.table.index.row_of(ns, k) for k in keys]
    assert all(engine.manager.table.index.col["flags"][r] & (IN_DRAM | IN_NVME) == IN_DRAM | IN_NVME for r in rows)
    assert engine.manager.views.dirty_stats()["dirty_blocks"] == 0
    assert engine.manager.views.stats()["nvme"]["used_bytes"] == engine.nvme.used_bytes
    # 3. nothing is written twice
    assert engine.write_behind(max_age_s=0) == 0
    engine.manager.catalog_log.sync_catalog()
    # 4. a crash: no write-back, no final catalog write; all of it comes back
    engine.mover.close()
    engine.catalog.close()
    engine.nvme.close()
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    assert states(engine) == {"agent": "cold"}
    assert loads(engine, keys) == 6
    engine.close()


def test_write_behind_never_writes_a_slot_the_manager_gave_away(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    keys = store(engine, "gone", 1, 3)
    engine.evict("gone", None)  # dropped: its slots are freed and the mover forgets them
    assert engine.mover.ledger.dirty == {}
    assert engine.write_behind(max_age_s=0) == 0
    assert engine.nvme.num_blocks == 0
    # a write that raced a drop (the worker wrote it just before it heard) is deleted again
    ns = namespace_of(fingerprint.digest)
    payload = torch.zeros(fingerprint.geometry.block_bytes, dtype=torch.uint8)
    engine.nvme.write(ns, keys[0], payload, fingerprint.digest)
    job = engine.manager.pressure.note_written_behind([(ns, keys[0], len(payload), "none")])
    assert job is not None and job.kind == JobKind.DROP
    engine.execute(job)
    assert engine.nvme.num_blocks == 0
    engine.close()


def test_pinned_sessions_are_written_through_as_they_grow(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    store(engine, "agent", 1, 2)
    engine.pin("agent", Tier.DRAM)
    keys = store(engine, "agent", 1, 5)  # the session grows by three blocks
    ns = namespace_of(fingerprint.digest)
    rows = [engine.manager.table.index.row_of(ns, k) for k in keys]
    col = engine.manager.table.index.col
    assert all(col["flags"][r] & IN_NVME for r in rows)  # durable
    assert all(col["pin"][r] == Tier.DRAM for r in rows)  # and the new blocks are pinned too
    engine = restart(engine, fingerprint, hbm, tmp_path, dram_blocks=32)
    # a DRAM pin comes back as a pin; its blocks load from NVMe on first use and then stay in DRAM
    assert states(engine) == {"agent": "pinned"}
    assert engine.manager.table.session("agent").pinned == Tier.DRAM
    assert loads(engine, keys) == 5
    rows = [engine.manager.table.index.row_of(ns, k) for k in keys]
    assert all(engine.manager.table.index.col["flags"][r] & IN_DRAM for r in rows)
    engine.maintain(force=True)
    assert all(engine.manager.table.index.col["flags"][r] & IN_DRAM for r in rows)  # never demoted
    engine.close()


def test_flush_writes_every_dirty_block_and_keeps_dram(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    store(engine, "a", 1, 3, 0)
    store(engine, "b", 2, 2, 3)
    result = engine.flush()
    assert result is not None and result.ok and result.kind == JobKind.FLUSH
    assert engine.manager.views.dirty_stats()["dirty_blocks"] == 0
    assert engine.manager.telemetry.counters["flushed_blocks"] == 5
    assert engine.manager.views.stats()["dram"]["blocks"] == 5 and engine.nvme.num_blocks == 5
    assert engine.flush() is None  # nothing left to do
    engine.close()


def test_a_dropped_session_stays_dropped_after_a_restart(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    store(engine, "keep", 1, 2, 0)
    store(engine, "drop", 2, 2, 2)
    engine.evict("drop", None)
    engine = restart(engine, fingerprint, hbm, tmp_path, dram_blocks=32)
    assert set(states(engine)) == {"keep"}
    engine.close()


# ---- a catalog that cannot be trusted ---------------------------------------------------------
def catalog_path(tmp_path, fingerprint):
    return tmp_path / "nvme" / "catalog" / f"{fingerprint.hex}.sqlite"


def seeded(fingerprint, hbm, tmp_path):
    """An engine directory with one session on NVMe and its catalog."""
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    keys = store(engine, "agent", 1, 3)
    engine.evict("agent", Tier.NVME)
    engine.close()
    return keys


def reopen_and_check(fingerprint, hbm, tmp_path, keys, *, listed: bool, warning: str | None):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    try:
        assert ("agent" in engine.manager.table.sessions) == listed
        if warning:
            assert warning in engine.manager.telemetry.warnings.get("catalog", ""), engine.manager.telemetry.warnings
        # whatever the catalog said, the blocks themselves are verified and still load
        assert loads(engine, keys) == 3
        store(engine, "next", 5, 1)  # and the new catalog takes writes
        engine.manager.catalog_log.sync_catalog()
    finally:
        engine.close()
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    assert "next" in engine.manager.table.sessions
    engine.close()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "zeroed_header"])
def test_a_damaged_catalog_is_moved_aside_and_rebuilt(fingerprint, hbm, tmp_path, damage):
    keys = seeded(fingerprint, hbm, tmp_path)
    path = catalog_path(tmp_path, fingerprint)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 3 + 100])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    else:
        path.write_bytes(b"\0" * 100 + data[100:])
    reopen_and_check(fingerprint, hbm, tmp_path, keys, listed=False, warning="moved to")
    assert list(path.parent.glob(f"{path.name}.bad-*"))  # kept for the operator, not deleted


def test_a_catalog_of_another_version_is_not_misread(fingerprint, hbm, tmp_path):
    keys = seeded(fingerprint, hbm, tmp_path)
    path = catalog_path(tmp_path, fingerprint)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = '99' WHERE key = 'schema'")
    reopen_and_check(fingerprint, hbm, tmp_path, keys, listed=False, warning="another kvtier version")


def test_a_catalog_of_another_model_is_not_misread(fingerprint, hbm, tmp_path):
    keys = seeded(fingerprint, hbm, tmp_path)
    other = ModelFingerprint("other-model", fingerprint.geometry)
    path = catalog_path(tmp_path, fingerprint)
    # another model's catalog copied over this one's name
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'fingerprint'", (other.hex,))
    reopen_and_check(fingerprint, hbm, tmp_path, keys, listed=False, warning="another model")
    # and two models in one NVMe dir keep two catalogs
    assert Catalog(tmp_path / "nvme", other).path != path


def test_a_damaged_row_is_skipped_not_misread(fingerprint, hbm, tmp_path):
    seeded(fingerprint, hbm, tmp_path)
    path = catalog_path(tmp_path, fingerprint)
    with sqlite3.connect(path) as db:  # another session whose row was altered behind the checksum
        db.execute("INSERT INTO sessions SELECT 'forged', ns, keys, meta FROM sessions WHERE session_id = 'agent'")
        db.execute("UPDATE tokens SET data = zeroblob(8) WHERE session_id = 'agent'")
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    assert set(engine.manager.table.sessions) == {"agent"}
    assert "1 damaged rows skipped" in engine.manager.telemetry.warnings["catalog"]
    # token ids that fail their checksum are not used: the snapshot carries none rather than wrong ones
    engine.snapshot("agent", tmp_path / "a.kvsnap")
    from kvtier.persist.snapshot import open_snapshot

    assert open_snapshot(tmp_path / "a.kvsnap").token_ids == ()
    engine.close()


def test_a_second_server_on_the_same_catalog_is_refused(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    with pytest.raises(CatalogLockedError, match=f"pid {os.getpid()}") as caught:
        Catalog(tmp_path / "nvme", fingerprint)
    assert "--nvme-dir" in caught.value.hint
    assert [str(os.getpid())] == [pid for _, pid in held_locks(tmp_path / "nvme")]
    engine.close()
    assert held_locks(tmp_path / "nvme") == []


def test_serve_refuses_an_nvme_dir_another_server_holds(fingerprint, hbm, tmp_path):
    from kvtier.config import Settings
    from kvtier.errors import ConfigError
    from kvtier.launch.serve import _check_nvme_dir

    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    settings = Settings(nvme_dir=str(tmp_path / "nvme"), nvme_bytes=1 << 20)
    with pytest.raises(ConfigError, match="in use by another kvtier server") as caught:
        _check_nvme_dir(settings, create=False)
    assert "its own --nvme-dir" in caught.value.hint
    engine.close()


def test_catalog_reads_many_sessions_without_splitting_their_keys(fingerprint, tmp_path):
    from kvtier.persist.catalog import SessionRecord
    from kvtier.plan.manager import TierManager

    catalog = Catalog(tmp_path, fingerprint)
    ns = namespace_of(fingerprint.digest)
    catalog.write([SessionRecord(f"s{i}", ns, os.urandom(32 * 8), 32, 128, None, 1.0, 2.0) for i in range(2000)])
    catalog.close()
    catalog = Catalog(tmp_path, fingerprint)
    manager = TierManager(fingerprint, 1 << 20, catalog=catalog)
    assert len(manager.table.sessions) == 2000 and manager.table.session("s7")._keys is None  # not split yet
    read_back = manager.table.session("s7")  # built field by field at start-up: none may be missing
    assert all(hasattr(read_back, name) for name in type(read_back).__slots__)
    assert manager.views.session_info("s7")["blocks"] == 8 and manager.views.session_info("s7")["state"] == "gone"
    assert len(manager.table.session("s7").keys) == 8
    catalog.close()


# ---- weights identity -------------------------------------------------------------------------
def write_safetensors(path, header: dict, payload: bytes = b"\0" * 64) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + payload)


def test_weights_identity_changes_when_weights_are_replaced_in_place(tmp_path, geometry):
    from kvtier.persist.weights import weights_identity

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    write_safetensors(tmp_path / "model.safetensors", {"w": {"dtype": "BF16", "shape": [4, 8],
                                                              "data_offsets": [0, 64]}})
    first = weights_identity(tmp_path)
    assert first and first == weights_identity(tmp_path)  # stable
    # a fine-tune with the same shapes changes the header's metadata or sizes
    write_safetensors(tmp_path / "model.safetensors", {"w": {"dtype": "BF16", "shape": [4, 8],
                                                              "data_offsets": [0, 64]},
                                                        "__metadata__": {"step": "2"}})
    second = weights_identity(tmp_path)
    assert second != first
    a, b = ModelFingerprint("m", geometry, first), ModelFingerprint("m", geometry, second)
    assert a.digest != b.digest  # so blocks of the old weights are never served the new ones
    assert ModelFingerprint.from_dict(a.to_dict()) == a
    # a hub id with nothing cached falls back to its revision; an unknown one to "" (not in the digest)
    assert weights_identity("org/not-cached-model", "v1.2") == "rev:v1.2"
    assert ModelFingerprint("m", geometry).digest == ModelFingerprint("m", geometry, "").digest


# ---- settings ---------------------------------------------------------------------------------
def test_write_behind_setting_is_checked():
    from kvtier.config import load_settings, write_behind_seconds
    from kvtier.errors import ConfigError

    assert write_behind_seconds("10") == 10.0 and write_behind_seconds("2.5s") == 2.5
    assert write_behind_seconds("off") is None
    assert load_settings(flags={"write_behind": "off"}, env={})[0].write_behind == "off"
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(ConfigError) as caught:
            load_settings(flags={"write_behind": bad}, env={})
        assert "write_behind" in caught.value.message and caught.value.hint


def test_dirty_age_grows_until_written(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    store(engine, "a", 1, 2)
    col = engine.manager.table.index.col
    col["dirty_since"][:] = np.float32(engine.manager.table.index.now() - 30)  # as if stored 30 s ago
    assert engine.manager.views.dirty_stats()["dirty_age_s"] >= 29
    engine.write_behind(0)
    assert engine.manager.views.dirty_stats() == {"dirty_blocks": 0, "dirty_bytes": 0, "dirty_age_s": 0.0,
                                                  "storing_blocks": 0}
    engine.close()


def test_a_failing_disk_stops_write_behind_with_a_warning_until_it_recovers(fingerprint, hbm, tmp_path):

    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    clock = disk_clock(engine)
    store(engine, "agent", 1, 3)
    engine.flush()
    store(engine, "later0", 3, 3)
    break_disk(tmp_path / "nvme")  # every commit now fails for real
    assert engine.write_behind(0) == 0
    telemetry = engine.manager.telemetry
    assert "nvme" in telemetry.warnings and telemetry.counters["write_behind_failures"] == 1
    assert engine.manager.views.dirty_stats()["dirty_blocks"] == 3  # still in DRAM, still owed to the disk
    heal_disk(tmp_path / "nvme")
    assert engine.write_behind(0) == 3 and engine.manager.views.dirty_stats()["dirty_blocks"] == 0
    assert "nvme" in engine.manager.telemetry.warnings  # one write that slips through does not end it at once...
    clock.advance(1.05)  # ...a write after the back-off (1 s after a first failure) does
    store(engine, "later", 2, 1, 5)
    assert engine.write_behind(0) == 1 and "nvme" not in engine.manager.telemetry.warnings
    engine.close()


def test_a_wiped_nvme_dir_is_recreated_with_its_catalog(fingerprint, hbm, tmp_path):
    import shutil

    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    keys = store(engine, "agent", 1, 3)
    engine.manager.catalog_log.sync_catalog()
    shutil.rmtree(tmp_path / "nvme")  # blocks, catalog and its lock file: all gone under the server
    assert engine.write_behind(0) == 3  # the DRAM copies are written to a new directory...
    assert "nvme_lost" in engine.manager.telemetry.warnings  # ...and the operator is told what was lost
    assert engine.manager.catalog_log.sync_catalog() and engine.catalog.recreated == 1
    assert held_locks(tmp_path / "nvme") == [(engine.catalog.path.with_suffix(".lock"), str(os.getpid()))]
    engine = restart(engine, fingerprint, hbm, tmp_path, dram_blocks=32)
    assert states(engine) == {"agent": "cold"} and loads(engine, keys) == 3
    engine.close()


def test_the_disk_probe_tells_a_failing_disk_from_a_healed_one(fingerprint, hbm, tmp_path):

    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    clock = disk_clock(engine)
    store(engine, "agent", 1, 1)
    engine.flush()  # the index exists
    assert engine.nvme.probe() is None
    break_disk(tmp_path / "nvme")
    error = engine.nvme.probe()
    assert error and "does not take writes" in error
    # the manager hears it like a failed write, and the probe that succeeds later like a good one
    engine.execute(engine.manager.pressure.note_written_behind([], error))
    assert "nvme" in engine.manager.telemetry.warnings
    heal_disk(tmp_path / "nvme")
    assert engine.nvme.probe() is None
    clock.advance(1.05)  # past the back-off
    engine.execute(engine.manager.pressure.note_written_behind([], None, disk_ok=True))
    assert "nvme" not in engine.manager.telemetry.warnings
    engine.close()


def test_a_wiped_nvme_dir_is_noticed_even_with_nothing_to_write(fingerprint, hbm, tmp_path):
    import shutil

    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    store(engine, "agent", 1, 3)
    engine.flush()  # every block is on NVMe: write-behind has nothing to write
    shutil.rmtree(tmp_path / "nvme")
    assert engine.write_behind(0) == 0
    assert "nvme_lost" in engine.manager.telemetry.warnings and (tmp_path / "nvme" / "segments").is_dir()
    engine.close()


def test_a_full_disk_warning_waits_for_room_the_budget_still_promises(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    manager = engine.manager
    clock = disk_clock(engine)
    full = f"NVMe tier: no space left on the device holding {tmp_path}"
    manager.pressure.note_written_behind([], full)
    clock.advance(1.05)  # past the back-off
    promised = manager.table.nvme.capacity - manager.table.nvme.used
    manager.pressure.note_written_behind([], None, disk_ok=True, disk_free=promised // 2)
    assert manager.telemetry.warnings["nvme"] == full  # a write fit into space a drop freed: still full
    manager.pressure.note_written_behind([], None, disk_ok=True, disk_free=promised)
    assert "nvme" not in manager.telemetry.warnings
    engine.close()


def test_a_full_disk_at_a_full_budget_stays_full_until_a_margin_is_free(fingerprint, hbm, tmp_path):
    """With the budget used up, "room for what the budget promises" is zero bytes: every successful
    write would end the warning while the disk sits at 0 bytes free and other writers race kvtier."""
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    manager = engine.manager
    clock = disk_clock(engine)
    full = f"NVMe tier: no space left on the device holding {tmp_path}"
    spent = manager.table.nvme.reserve(manager.table.nvme.capacity - manager.table.nvme.used)  # the budget is spent
    manager.pressure.note_written_behind([], full)
    clock.advance(1.05)
    manager.pressure.note_written_behind([], None, disk_ok=True, disk_free=4096)
    assert manager.telemetry.warnings["nvme"] == full
    manager.pressure.note_written_behind([], None, disk_ok=True, disk_free=manager.pressure.full_disk_margin())
    assert "nvme" not in manager.telemetry.warnings
    manager.table.nvme.release(spent)
    engine.close()


def test_the_shutdown_write_back_writes_every_dirty_block_batch_after_batch(fingerprint, hbm, tmp_path):
    """Write-behind takes one group commit's worth per call; the shutdown write-back must keep going
    until nothing is owed to the disk."""
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    keys = store(engine, "agent", 1, 6)
    engine.mover.behind.batch_bytes = 1  # one block per group commit
    assert engine.manager.views.dirty_stats()["dirty_blocks"] == 6
    engine.close()  # the write-back
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    assert loads(engine, keys) == 6
    engine.close()


def test_token_counts_mean_the_same_warm_cold_or_restored(fingerprint, hbm, tmp_path):
    """`tokens` is what a next turn can load (full stored blocks) for a session served here, read back
    from the catalog after a restart, or restored from a snapshot; the last prompt's length is
    `prompt_tokens`. (kvtier top showed block-aligned counts for some and raw ones for others.)"""
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=32)
    tokens = tokens_of(5, 4) + [7, 8, 9]  # a prompt 3 tokens past its last full block
    keys = chain_block_hashes(tokens, BT)
    ns = namespace_of(engine.fingerprint.digest)
    engine.manager.planner.record_session("s", ns, keys, len(tokens), token_ids=tokens)
    engine.store("s", ns, keys, [0, 1, 2, 3], len(tokens))
    engine.evict("s", Tier.NVME)
    row = engine.manager.views.session_info("s")
    assert (row["tokens"], row["prompt_tokens"]) == (4 * BT, 4 * BT + 3)
    assert engine.snapshot("s", tmp_path / "s.kvsnap").ok
    engine = restart(engine, fingerprint, hbm, tmp_path, dram_blocks=32)
    cold = engine.manager.views.session_info("s")
    assert cold["state"] == "cold" and cold["tokens"] == 4 * BT
    engine.evict("s", None)  # dropped everywhere, then back from its snapshot
    engine.restore(tmp_path / "s.kvsnap")
    restored = engine.manager.views.session_info("s")
    assert restored["state"] == "warm" and restored["tokens"] == 4 * BT
    engine.close()
