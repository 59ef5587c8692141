"""`kvtier top` shows a timed pin's and a retention hint's time left: in the state column and in the
session's details, counted from the snapshot's own time (so a recording replays the same), collected
from a real admin server (an in-process engine behind a real Unix socket)."""
from __future__ import annotations

import asyncio
import time

from support.clock import FakeClock
from support.engine import make_engine

from kvtier.control.client import AdminClient
from kvtier.control.local import LocalAdmin
from kvtier.plan.index import Tier, chain_block_hashes, namespace_of
from kvtier.tui.app import TopApp
from kvtier.tui.collector import Collector
from kvtier.tui.model import SessionRow, Snapshot
from kvtier.tui.widgets import COLUMNS

COLUMN_STATE = [key for key, _ in COLUMNS].index("state")


def row(session_id: str, state: str, pinned=None, pin_expires_at=None, retain_expires_at=None, retain_priority=None):
    return SessionRow(session_id, state, 64, 4, 4, 0, 4096, 0, pinned, 900.0, None, "none", "none",
                      pin_expires_at=pin_expires_at, retain_expires_at=retain_expires_at,
                      retain_priority=retain_priority)


def test_the_state_column_shows_the_time_left():
    snap = Snapshot(taken=1000.0, connected=True, sessions=(
        row("timed", "pinned", "dram", pin_expires_at=1000.0 + 1799), row("kept", "warm", retain_expires_at=1300.0,
                                                                         retain_priority=2),
        row("both", "pinned", "nvme", pin_expires_at=1030.0, retain_expires_at=1000.0 + 7200, retain_priority=1),
        row("plain", "pinned", "dram"), row("cold", "cold")))
    app = TopApp(lambda: None, first=snap)
    states = {r.session_id: str(app._cells(r)[COLUMN_STATE]) for r in snap.sessions}
    assert states == {"timed": "pinned·dram 29m", "kept": "warm·kept 5m", "both": "pinned·nvme <1m·kept 2h",
                      "plain": "pinned·dram", "cold": "cold"}
    assert Snapshot.from_json(snap.to_json()) == snap  # recordings keep them


def test_the_collector_and_the_details_page_show_them(fingerprint, hbm, tmp_path):
    clock = FakeClock(time.time() - 60)  # a minute ago: the dashboard counts from its own snapshots' time
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=16, nvme_blocks=16, wall_clock=clock)
    engine.store("agent", namespace_of(fingerprint.digest), chain_block_hashes(list(range(64)), 16), [0, 1, 2, 3],
                 num_tokens=64)
    admin = LocalAdmin(engine, tmp_path / "a.sock").start()
    try:
        engine.pin("agent", Tier.NVME, for_s=1800)
        with admin.lock:
            engine.manager.planner.retain("agent", 600, 3)
        snap = Collector(AdminClient(str(tmp_path / "a.sock"))).poll()
        agent = next(r for r in snap.sessions if r.session_id == "agent")
        assert (agent.pin_expires_at, agent.retain_expires_at, agent.retain_priority) == \
            (clock.now + 1800, clock.now + 600, 3)
        page = asyncio.run(_details(snap))
        assert "(pinned to nvme, for 29m" in page and "retained    9m" in page and "priority 3" in page, page
    finally:
        admin.stop()
        engine.close(write_back=False)


async def _details(snap: Snapshot) -> str:
    app = TopApp(lambda: None, first=snap, interval=3600)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("enter")
        return str(app.screen.query_one("Static").render())
