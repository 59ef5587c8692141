"""Timed pins and retention hints in the session catalog: kept across a restart, dropped at start-up
once their time is up, and catalogs written before them still read (a real SQLite file, a real
``TierManager`` reading it back, the wall clock a ``FakeClock``)."""
from __future__ import annotations

import sqlite3
import struct

import pytest
import xxhash
from support.clock import FakeClock

from kvtier.persist.catalog import Catalog, SessionRecord
from kvtier.plan.index import Tier, chain_block_hashes, namespace_of
from kvtier.plan.manager import TierManager

BT = 16
OLD_META = struct.Struct("<IQbdd")  # the row format before time limits: key_len, tokens, pin, created, last use


@pytest.fixture
def clock():
    return FakeClock(1_700_000_000.0)


def open_manager(fingerprint, tmp_path, clock) -> TierManager:
    return TierManager(fingerprint, 16 * fingerprint.geometry.block_bytes, catalog=Catalog(tmp_path, fingerprint),
                       wall_clock=clock)


def close(manager: TierManager) -> None:
    manager.catalog_log.sync_catalog()
    manager.catalog_log.catalog.close()


def meta_of(fingerprint, tmp_path, session_id: str) -> bytes:
    path = tmp_path / "catalog" / f"{fingerprint.hex}.sqlite"
    with sqlite3.connect(path) as db:
        return bytes(db.execute("SELECT meta FROM sessions WHERE session_id = ?", (session_id,)).fetchone()[0])


def test_a_timed_pin_and_a_retention_hint_survive_a_restart(fingerprint, tmp_path, clock):
    manager = open_manager(fingerprint, tmp_path, clock)
    ns = namespace_of(fingerprint.digest)
    manager.planner.record_session("agent", ns, chain_block_hashes(list(range(4 * BT)), BT), 4 * BT)
    manager.planner.pin("agent", Tier.NVME, for_s=3600)
    manager.planner.retain("agent", 600, 3)
    close(manager)
    clock.advance(300)  # a restart five minutes later
    manager = open_manager(fingerprint, tmp_path, clock)
    info = manager.views.session_info("agent")
    assert (info["pinned"], info["pin_expires_at"], info["pin_left_s"]) == ("nvme", clock.now + 3300, 3300)
    assert (info["retain_left_s"], info["retain_priority"]) == (300, 3)
    clock.advance(3300)  # and they still end on time after it
    assert manager.planner.expire() == ["agent"]
    info = manager.views.session_info("agent")
    assert (info["pinned"], info["retain_left_s"]) == (None, None)
    close(manager)


def test_an_expired_pin_found_at_start_is_dropped(fingerprint, tmp_path, clock):
    manager = open_manager(fingerprint, tmp_path, clock)
    ns = namespace_of(fingerprint.digest)
    manager.planner.record_session("agent", ns, chain_block_hashes(list(range(2 * BT)), BT), 2 * BT)
    manager.planner.pin("agent", Tier.DRAM, for_s=60)
    manager.planner.retain("agent", 60, 2)
    close(manager)
    clock.advance(120)  # the server was down when both ended
    manager = open_manager(fingerprint, tmp_path, clock)
    agent = manager.table.session("agent")
    assert (agent.pinned, agent.pin_expires, agent.retain_until) == (None, None, None)
    assert manager.telemetry.counters["pins_expired"] == 1
    assert manager.views.session_info("agent")["state"] != "pinned"
    close(manager)  # and the catalog forgets them: the row is back in the old format
    assert len(meta_of(fingerprint, tmp_path, "agent")) == OLD_META.size + 8
    manager = open_manager(fingerprint, tmp_path, clock)
    assert manager.table.session("agent").pinned is None
    close(manager)


def test_a_row_of_the_old_format_still_loads_with_no_time_limit(fingerprint, tmp_path, clock):
    """A catalog written before time limits existed: its row packed by hand as the old writer did
    (fields, then the xxh3 of id, namespace, keys and fields)."""
    Catalog(tmp_path, fingerprint).close()  # the file, its schema and meta
    ns = namespace_of(fingerprint.digest)
    keys = b"".join(chain_block_hashes(list(range(3 * BT)), BT))
    fields = OLD_META.pack(32, 3 * BT, int(Tier.NVME), 1000.0, 2000.0)
    crc = xxhash.xxh3_64_intdigest(b"".join((b"old-agent", b"\0", ns, keys, fields)))
    with sqlite3.connect(tmp_path / "catalog" / f"{fingerprint.hex}.sqlite") as db:
        db.execute("INSERT INTO namespaces (id, namespace) VALUES (1, ?)", (ns,))
        db.execute("INSERT INTO sessions VALUES (?, 1, ?, ?)", ("old-agent", keys, fields + struct.pack("<Q", crc)))
    manager = open_manager(fingerprint, tmp_path, clock)
    assert manager.catalog_log.catalog.bad_rows == 0
    agent = manager.table.session("old-agent")
    assert (agent.pinned, agent.pin_expires, agent.retain_until, agent.num_tokens) == (Tier.NVME, None, None, 3 * BT)
    clock.advance(10 * 365 * 86400)
    assert manager.planner.expire() == []
    assert manager.table.session("old-agent").pinned == Tier.NVME  # pinned until unpinned
    close(manager)


def test_rows_without_a_time_limit_keep_the_old_format(fingerprint, tmp_path):
    """So a catalog stays readable by the kvtier before this one, except for the sessions with a time
    limit (which it skips as damaged rows)."""
    ns = namespace_of(fingerprint.digest)
    catalog = Catalog(tmp_path, fingerprint)
    catalog.write([SessionRecord("plain", ns, b"k" * 32, 32, 16, 2, 1.0, 2.0),
                   SessionRecord("timed", ns, b"k" * 32, 32, 16, 2, 1.0, 2.0, pin_expires=5.0, retain_until=6.0,
                                 retain_priority=7)])
    catalog.close()
    assert len(meta_of(fingerprint, tmp_path, "plain")) == OLD_META.size + 8
    assert len(meta_of(fingerprint, tmp_path, "timed")) > OLD_META.size + 8
    catalog = Catalog(tmp_path, fingerprint)
    read = {s.session_id: s for s in catalog.load()}
    catalog.close()
    assert (read["timed"].pin_expires, read["timed"].retain_until, read["timed"].retain_priority) == (5.0, 6.0, 7)
    assert (read["plain"].pin_expires, read["plain"].retain_until) == (None, None)


def test_a_damaged_time_limit_is_a_damaged_row(fingerprint, tmp_path):
    ns = namespace_of(fingerprint.digest)
    catalog = Catalog(tmp_path, fingerprint)
    catalog.write([SessionRecord("timed", ns, b"k" * 32, 32, 16, 2, 1.0, 2.0, pin_expires=5.0)])
    catalog.close()
    path = tmp_path / "catalog" / f"{fingerprint.hex}.sqlite"
    meta = bytearray(meta_of(fingerprint, tmp_path, "timed"))
    meta[OLD_META.size + 1] ^= 0xFF  # inside pin_expires
    with sqlite3.connect(path) as db:
        db.execute("UPDATE sessions SET meta = ? WHERE session_id = 'timed'", (bytes(meta),))
    catalog = Catalog(tmp_path, fingerprint)
    assert catalog.load() == [] and catalog.bad_rows == 1
    catalog.close()
