"""`kvtier top`: every key action through Textual's Pilot against a real admin server (an in-process
tier engine on a real Unix socket), the collector's degraded modes, record/replay, SVG snapshots of
a recording at 80x24 and 120x40, and the dashboard in a real pseudo-terminal."""
from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.clock import FakeClock
from support.harness import PtyApp, demo_admin
from typer.testing import CliRunner

from kvtier.cli.main import app as cli_app
from kvtier.control.client import AdminClient
from kvtier.errors import NotFoundError
from kvtier.plan.index import Tier
from kvtier.tui.app import TopApp
from kvtier.tui.collector import Collector, Nvml, replay
from kvtier.tui.model import Snapshot
from kvtier.tui.widgets import COLUMNS

REPLAY = Path(__file__).parent / "data" / "top.jsonl"
COLUMN_NEXT = [key for key, _ in COLUMNS].index("next")
runner = CliRunner()


def aio(fn):
    """Run an async test on a fresh event loop (Textual's Pilot is async)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


@pytest.fixture
def live(tmp_path):
    admin, engine = demo_admin(tmp_path, 30, churn=False)
    admin.client = AdminClient(str(tmp_path / "admin.sock"))
    admin.sock = str(tmp_path / "admin.sock")
    yield admin
    admin.stop()
    engine.close(write_back=False)


def make_app(admin, interval: float = 0.2) -> TopApp:
    return TopApp(Collector(admin.client).poll, interval=interval, client=admin.client)


async def settle(pilot, app, admin=None, polls: int = 2) -> None:
    """Let the action's worker post its write, the job run, and the next polls land."""
    await app.workers.wait_for_complete([w for w in app.workers if w.group == "actions"])
    if admin is not None:
        admin.drain()
    target = app.shown + polls
    app.poll_now()
    for _ in range(100):
        if app.shown >= target:
            return
        await pilot.pause(0.05)


async def select(pilot, app, session: str) -> None:
    await pilot.press("home")  # the selection follows its session across re-sorts: start at the top
    for _ in range(200):
        if app.selected_session() == session:
            return
        await pilot.press("down")
    raise AssertionError(f"{session} not reachable; at {app.selected_session()}")


def manager_session(admin, session: str):
    return admin.engine.manager.table.sessions[session]


@aio
async def test_pin_to_nvme_then_unpin(live):
    app = make_app(live)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        await pilot.press("o", "o", "o")  # sort by session id: a stable order
        await select(pilot, app, "session-0004")
        await pilot.press("p", "n")
        await settle(pilot, app, live)
        assert manager_session(live, "session-0004").pinned == Tier.NVME
        row = app._row("session-0004")
        assert row.pinned == "nvme" and row.state == "pinned"
        await pilot.press("p")  # pinned: p unpins, no question asked
        await settle(pilot, app, live)
        assert manager_session(live, "session-0004").pinned is None


@aio
async def test_evict_to_nvme_and_drop_with_confirmation(live):
    app = make_app(live)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        await pilot.press("o", "o", "o")
        await select(pilot, app, "session-0028")
        assert app._row("session-0028").state == "warm"
        await pilot.press("e", "n")
        await settle(pilot, app, live)
        info = live.engine.manager.views.session_info("session-0028")
        assert info["blocks_nvme"] == 2 and info["blocks_dram"] == 0
        assert app._row("session-0028").state == "cold"
        await pilot.press("e", "x", "n")  # drop, then "no": nothing happens
        await settle(pilot, app, live)
        assert "session-0028" in live.engine.manager.table.sessions
        await pilot.press("e", "x", "y")  # drop, confirmed
        await settle(pilot, app, live)
        with pytest.raises(NotFoundError):
            live.engine.manager.table.session("session-0028")
        assert app._row("session-0028") is None


@aio
async def test_escape_cancels_every_question(live):
    app = make_app(live)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        before = live.engine.manager.views.session_info(app.selected_session())
        for key in ("p", "e", "s", "r", "slash"):
            await pilot.press(key, "escape")
            assert len(app.screen_stack) == 1, key
        await settle(pilot, app, live)
        assert live.engine.manager.views.session_info(before["session_id"]) == {**before, "idle_seconds": pytest.approx(
            before["idle_seconds"], abs=30)}
        assert live.ops.jobs == {}


@aio
async def test_snapshot_then_restore_after_a_drop(live):
    app = make_app(live)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        await pilot.press("o", "o", "o")
        await select(pilot, app, "session-0007")
        await pilot.press("s", "enter")  # the default path, in the server's snapshot dir
        await settle(pilot, app, live)
        path = Path(app.snapshot.snapshot_dir) / "session-0007.kvsnap"
        assert path.is_file()
        assert any(j.kind == "snapshot" and j.state == "done" for j in app.snapshot.jobs)
        await pilot.press("e", "x", "y")
        await settle(pilot, app, live)
        assert "session-0007" not in live.engine.manager.table.sessions
        await pilot.press("r")
        ask = app.screen.query_one("#ask")
        ask.value = str(path)
        await pilot.press("enter")
        await settle(pilot, app, live)
        assert live.engine.manager.views.session_info("session-0007")["blocks_dram"] == 2
        assert app._row("session-0007") is not None


@aio
async def test_a_refused_write_is_reported_not_raised(live):
    app = make_app(live)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        await pilot.press("r")
        app.screen.query_one("#ask").value = "/nonexistent/x.kvsnap"
        await pilot.press("enter")
        await settle(pilot, app, live)
        notes = [n.message for n in app._notifications]
        assert any("restore" in n and "hint" in n for n in notes), notes
        assert app.is_running


@aio
async def test_filter_sort_details_help_navigation_and_quit(live):
    app = make_app(live)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        table = app.query_one("#sessions")
        assert table.row_count <= table.visible_rows() < 30  # only the window is in the table
        await pilot.press("slash")
        await pilot.press(*"0001")
        await pilot.press("enter")
        assert [r.session_id for r in app._rows_all] == ["session-0001"]
        await pilot.press("slash", "ctrl+u", "enter")  # empty filter: everything again
        assert len(app._rows_all) == 30
        await pilot.press("o", "o", "o")  # by session id
        assert app._rows_all[0].session_id == "session-0000"
        await pilot.press("end")
        assert app.selected_session() == "session-0029"
        assert app._keys[-1] == "session-0029"  # the window scrolled to the end
        await pilot.press("home", "pagedown")
        assert app.selected_session() == f"session-{table.visible_rows() - 1:04d}"
        await pilot.press("enter")
        assert "session " + app.selected_session() in str(app.screen.query_one("Static").render())
        await pilot.press("escape", "question_mark")
        assert "Bars: HBM" in str(app.screen.query_one("Static").render())
        await pilot.press("escape", "q")
    assert app.return_code == 0


@aio
async def test_no_server_shows_a_banner_and_keeps_retrying(tmp_path):
    client = AdminClient(str(tmp_path / "none.sock"))
    app = TopApp(Collector(client).poll, interval=0.1, client=client)
    async with app.run_test(size=(80, 24)) as pilot:
        for _ in range(60):
            if app.shown >= 3:
                break
            await pilot.pause(0.05)
        assert app.shown >= 3 and not app.snapshot.connected
        banner = str(app.query_one("#banner").render())
        assert "no kvtier server" in banner and "kvtier serve" in banner
        await pilot.press("p")  # nothing selected: a warning, no crash
        assert app.is_running


def test_collector_rates_and_missing_nvml(live):
    clock = FakeClock(time.time())
    collector = Collector(live.client, clock=clock)
    first = collector.poll()
    assert first.connected and len(first.sessions) == 30
    assert all(link.bytes_per_s is None for link in first.links if link.source == "kvtier")  # one sample
    warm = next(r.session_id for r in first.sessions if r.state == "warm")
    live.client.post(live.client.session_path(warm, "evict"), {"to": "nvme"})
    live.drain()
    clock.advance(0.05)  # a rate needs time between the two samples
    second = collector.poll()
    demote = next(link for link in second.links if link.name == "DRAM→NVMe")
    assert demote.bytes_per_s > 0 and demote.history
    nvml = Nvml()
    if nvml.handle is None:  # this CPU box: N/A values and a banner that says why
        assert nvml.reason and any(nvml.reason in b for b in second.banners)
        assert all(link.bytes_per_s is None for link in second.links if link.source == "nvml")


def test_top_asks_for_its_rows_and_counts_every_session_from_the_server(live, monkeypatch):
    """With more sessions than it shows, top takes the most recent page and the server's totals
    (100k sessions then cost it what 1,000 do)."""
    import kvtier.tui.collector as collector

    monkeypatch.setattr(collector, "SESSION_ROWS", 7)
    snap = Collector(live.client).poll()
    assert len(snap.sessions) == 7 and snap.sessions_total == 30
    assert sum(n for _state, n in snap.session_states) == 30
    last_use = [row.last_use for row in snap.sessions]
    assert last_use == sorted(last_use, reverse=True)  # the most recent ones


def test_snapshot_round_trips_through_json(live):
    snapshot = Collector(live.client).poll()
    assert Snapshot.from_json(snapshot.to_json()) == snapshot
    with pytest.raises(ValueError):
        Snapshot.from_json(json.dumps({"version": 99}))


def test_once_json_record_and_replay(live, tmp_path):
    record = tmp_path / "rec.jsonl"
    out = runner.invoke(cli_app, ["top", "--once", "--json", "--socket", live.sock, "--record", str(record)])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["connected"] and len(doc["sessions"]) == 30
    again = runner.invoke(cli_app, ["top", "--once", "--json", "--replay", str(record)])
    assert again.exit_code == 0 and json.loads(again.output)["sessions"] == doc["sessions"]
    text = runner.invoke(cli_app, ["top", "--once", "--socket", live.sock])
    assert text.exit_code == 0 and "session-0029" in text.output and "DRAM→NVMe" in text.output


@pytest.mark.parametrize("args, message", [
    (["--replay", "/nonexistent.jsonl"], "cannot read recording"),
    (["--json"], "--json needs --once"),
    ([], "needs a terminal"),
])
def test_top_bad_input_is_a_clear_error(tmp_path, args, message):
    result = runner.invoke(cli_app, ["top", *args, "--socket", str(tmp_path / "none.sock")])
    assert result.exit_code == 2 and message in result.output and "hint:" in result.output


def test_a_file_that_is_not_a_recording_is_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"not": "a snapshot"}\n')
    result = runner.invoke(cli_app, ["top", "--once", "--replay", str(bad)])
    assert result.exit_code == 2 and "not a kvtier top recording" in result.output
    with pytest.raises(Exception):
        list(replay(str(bad)))


def test_recording_in_the_repo_replays():
    snapshots = list(replay(str(REPLAY)))
    assert len(snapshots) == 3 and {r.state for r in snapshots[0].sessions} >= {"warm", "cold", "pinned", "hot"}


@pytest.fixture
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def replay_app() -> TopApp:
    snapshots = replay(str(REPLAY))
    return TopApp(lambda: None, interval=3600, first=next(snapshots))


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_dashboard_snapshot(snap_compare, utc, size):
    assert snap_compare(replay_app(), terminal_size=size)


def test_help_snapshot_at_80x24(snap_compare, utc):
    assert snap_compare(replay_app(), terminal_size=(80, 24), press=["question_mark"])


def test_in_a_real_terminal(live):
    """The dashboard in a pseudo-terminal: it draws the sessions, answers a key, and quits cleanly."""
    app = PtyApp(["--socket", live.sock, "--interval", "0.5"], size=(80, 24))
    try:
        assert app.read_until(b"session-00", 60), app.seen[-2000:]
        app.send(b"?")
        assert app.read_until(b"Bars: HBM", 10)
        app.send(b"\x1b")
        app.drain(0.3)
    finally:
        code = app.close()
    assert code == 0


@pytest.mark.parametrize("how", ["default", "NO_COLOR", "--no-color"])
def test_no_color_draws_without_colors(live, how):
    """NO_COLOR=1 or kvtier --no-color: the real terminal gets no color escapes (bold may stay)."""

    app = PtyApp(["--socket", live.sock, "--interval", "0.5"], size=(80, 24),
                 env={"NO_COLOR": "1"} if how == "NO_COLOR" else None,
                 root_args=("--no-color",) if how == "--no-color" else ())
    try:
        assert app.read_until(b"session-00", 60), app.seen[-2000:]
        app.drain(0.5)
    finally:
        app.close()
    assert bool(_hues(app.seen)) == (how == "default"), _hues(app.seen)[:3]


_GREYS_256 = {0, 7, 8, 15, 16, 59, 102, 145, 188, 231, *range(232, 256)}


def _hues(screen: bytes) -> list[tuple[int, ...]]:
    """Every non-grey color a terminal was told to draw (Textual's NO_COLOR mode is greyscale)."""
    import re

    found = []
    for params in re.findall(rb"\x1b\[([0-9;]*)m", screen):
        codes = [int(p) for p in params.split(b";") if p]
        i = 0
        while i < len(codes):
            if codes[i] in (38, 48) and i + 2 < len(codes) and codes[i + 1] == 5:
                if codes[i + 2] not in _GREYS_256:
                    found.append((codes[i + 2],))
                i += 3
            elif codes[i] in (38, 48) and i + 4 < len(codes) and codes[i + 1] == 2:
                rgb = tuple(codes[i + 2:i + 5])
                if len(set(rgb)) > 1:
                    found.append(rgb)
                i += 5
            else:
                if 31 <= codes[i] <= 36 or 41 <= codes[i] <= 46 or 91 <= codes[i] <= 96:
                    found.append((codes[i],))
                i += 1
    return found


def test_top_never_imports_torch_or_vllm(live):
    code = ("import sys; from kvtier.cli.main import main; sys.argv = ['kvtier', 'top', '--once', '--socket', "
            f"{live.sock!r}]\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('LOADED', sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOADED []" in out.stdout, out.stdout[-500:] + out.stderr[-2000:]


@aio
async def test_the_next_turn_column_shows_the_cost_models_call(live):
    from kvtier.plan.costmodel import GB, CostModel, LinkRates, PrefillModel

    geometry = live.engine.fingerprint.geometry
    live.ops.cost = CostModel(LinkRates(20 * GB, 3 * GB), geometry.block_tokens, geometry.block_bytes,
                              geometry.block_bytes, prefill=PrefillModel(0.01, 1e-3, 1e-9))
    app = make_app(live)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        row = app._row(app.selected_session())
        assert row.decision == "load" and row.restore_s < row.recompute_s
        assert str(app._cells(row)[COLUMN_NEXT]).startswith("load ")
        live.ops.cost = CostModel(LinkRates(1e3, 1e3), geometry.block_tokens, geometry.block_bytes,
                                  geometry.block_bytes, prefill=PrefillModel(0.01, 1e-3, 1e-9))
        await settle(pilot, app)
        row = app._row(app.selected_session())
        assert row.decision == "recompute" and str(app._cells(row)[COLUMN_NEXT]).startswith("recompute ")



@aio
async def test_session_details_say_why_its_last_turns_recomputed(live):
    """enter on a session: its details end with its last turns and each one's reason, asked of the server."""
    from kvtier.plan.reasons import TurnRecord

    live.engine.manager.turns.add(TurnRecord(
        "session-0003", "req-1", time.time(), 540, 0, 512, 256, "dram", 284, "diverged",
        "prefix diverged at token 256 from the stored session (512 tokens)", turn=2, diverged_at=256, finished=True))
    app = make_app(live)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        app.filter = "session-0003"
        app._sessions(app.snapshot)
        await pilot.press("enter")
        page = str(app.screen.query_one("Static").render())
        assert "last turns" in page and "[diverged] prefix diverged at token 256" in page, page
        await pilot.press("escape")
        app.filter = "session-0004"  # a session with no turn recorded says so
        app._sessions(app.snapshot)
        await pilot.press("enter")
        assert "last turns: none since the server started" in str(app.screen.query_one("Static").render())


@aio
async def test_the_shared_tier_shows_like_the_others(utc):
    """A server with a shared tier: its row in the tiers panel (the store's memory against its cap,
    blocks published, codec), its hit rate, its two links, and the store's warning in the banner."""
    from dataclasses import replace

    from kvtier.tui.collector import _hit_rates, _tiers
    from kvtier.tui.widgets import LinksPanel, TiersPanel

    first = next(replay(str(REPLAY)))
    shared = {"url": "redis://10.0.0.5:6379/0", "state": "down", "codec": "none+zstd", "published_blocks": 1234,
              "server": {"used_memory": 3 << 30, "maxmemory": 8 << 30}}
    status_tiers = {"hbm": {}, "dram": {"used_bytes": 1, "capacity_bytes": 2}, "nvme": {}}
    tiers = _tiers(status_tiers, shared)
    assert tiers[-1].name == "shared" and tiers[-1].fraction == 3 / 8 and tiers[-1].blocks == 1234
    assert _tiers(status_tiers, None)[-1].name == "nvme"  # no shared tier, no row
    rates = dict(_hit_rates({"prompt_tokens": 1000, "fetched_blocks": 4}, 128, shared=True))
    assert rates["shared"] == 4 * 128 / 1000
    links = first.links + tuple(replace(first.links[0], name=name, bytes_per_s=2e9, history=(1e9, 2e9))
                                for name in ("shared→DRAM", "DRAM→shared"))
    snap = replace(first, tiers=first.tiers + (tiers[-1],), links=links,
                   hit_rates=first.hit_rates + (("shared", 0.25),),
                   banners=("shared: shared store redis://10.0.0.5:6379/0 is unreachable: serving without it",))
    app = TopApp(lambda: None, interval=3600, first=snap)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        tiers_text = str(app.query_one(TiersPanel).render())
        assert "SHRD" in tiers_text and "none+zst" in tiers_text and "SHRD 25%" in tiers_text
        links_text = str(app.query_one(LinksPanel).render())
        assert "shared r+w" in links_text or "shared→DRAM" in links_text
        assert "serving without it" in str(app.query_one("#banner").render())
