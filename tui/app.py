"""``kvtier top``: the Textual dashboard. Widgets only render the latest ``Snapshot``; a thread worker
polls the source (the collector, or a recording) and schedules its own next poll.

Keys: p pin/unpin, e evict, s snapshot, r restore, / filter, o sort, enter details, i next instance,
a all instances' sessions, ? help, q quit.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import DataTable, Footer, Static

from kvtier.control.client import AdminClient
from kvtier.errors import KvtierError
from kvtier.tui.model import SessionRow, Snapshot
from kvtier.tui.widgets import (
    COLUMNS,
    HELP,
    SORTS,
    STATE_STYLE,
    Ask,
    BoxPanel,
    Choice,
    Header,
    JobsPanel,
    LinksPanel,
    Page,
    Panel,
    SessionTable,
    TiersPanel,
    idle_text,
)
from kvtier.units import human_bytes, human_duration

__all__ = ["TopApp"]

# ---- the app ------------------------------------------------------------------------------------
class TopApp(App):
    TITLE = "kvtier top"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #header { height: 1; background: $primary; color: $text; padding: 0 1; }
    #banner { height: auto; max-height: 3; background: $warning 25%; padding: 0 1; }
    #panels { height: 7; }
    #tiers { width: 1fr; height: 100%; padding: 0 1; }
    #links { width: 1fr; height: 100%; padding: 0 1; }
    #sessions { height: 1fr; }
    #jobs { height: 3; padding: 0 1; border-top: solid $primary; }
    #box { height: auto; max-height: 12; padding: 0 1; border-bottom: solid $primary; }
    """
    BINDINGS = [
        Binding("p", "pin", "pin"), Binding("e", "evict", "evict"), Binding("s", "snapshot", "snapshot"),
        Binding("r", "restore", "restore"), Binding("slash", "filter", "filter"), Binding("o", "sort", "sort"),
        Binding("i", "next_instance", "instance", show=False), Binding("a", "all_instances", "all", show=False),
        Binding("question_mark", "help", "help"), Binding("q", "quit", "quit"),
    ]

    def __init__(self, source: Callable[[], Snapshot | None], interval: float = 1.0, client=None,
                 record: Callable[[Snapshot], None] | None = None, first: Snapshot | None = None, box=None):
        super().__init__()
        self.source, self.interval, self.client, self.record = source, interval, client, record
        self.box = box  # a BoxCollector when the dashboard shows the whole box
        self.snapshot: Snapshot | None = first
        self.filter = ""
        self.sort = 0
        self._rows_all: list[SessionRow] = []  # filtered and sorted
        self._selected: str | None = None  # the selected session, kept across reorders
        self._cursor = 0  # its index in _rows_all
        self._top = 0  # index of the first row on screen
        self._keys: list[str] = []  # rows now in the table (the window)
        self._drawn: list[tuple] = []  # the cells on screen, by position
        self._banners: tuple[str, ...] | None = None
        self._poke = threading.Event()
        self._stopping = threading.Event()
        self._poller: threading.Thread | None = None
        self.shown = 0  # snapshots rendered (tests and the benchmark wait on it)

    # ---- layout --------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(id="header")
        yield Static(id="banner")
        yield BoxPanel(id="box")
        with Horizontal(id="panels"):
            yield TiersPanel(id="tiers")
            yield LinksPanel(id="links")
        table = SessionTable(id="sessions", cursor_type="row", zebra_stripes=False, show_cursor=True)
        for key, label in COLUMNS:
            table.add_column(label, key=key)
        yield table
        yield JobsPanel(id="jobs")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#box", BoxPanel).display = False  # until a snapshot shows several instances or GPUs
        self.query_one("#sessions", DataTable).focus()
        if self.snapshot is not None:
            self.show(self.snapshot)
        else:
            self._header(None)
        # Its own thread, not a Textual thread worker: those share the loop's default executor, whose
        # idle count can include the thread this never-ending loop holds, so an action's worker would
        # queue behind it with no thread to run it (a key that never acts).
        self._poller = threading.Thread(target=self._poll_loop, name="kvtier-top-poll", daemon=True)
        self._poller.start()

    def on_resize(self, event) -> None:
        # tall terminals get every link on its own line; 24 rows get six summed ones
        self.query_one("#panels").styles.height = 12 if event.size.height >= 36 else 7

    def on_unmount(self) -> None:
        self._stopping.set()
        self._poke.set()
        if self._poller is not None:
            self._poller.join(timeout=5)  # it stops at its next check (a poll in flight may finish first)

    # ---- data ----------------------------------------------------------------------------------
    def _poll_loop(self) -> None:
        """Poll, hand the snapshot to the UI thread, then wait for the next tick (or a poke)."""
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                snapshot = self.source()
            except StopIteration:
                snapshot = None
            if snapshot is not None:
                if self.record is not None:
                    self.record(snapshot)
                if self._stopping.is_set():
                    return
                try:
                    self.call_from_thread(self.show, snapshot)
                except RuntimeError:  # the app is closing
                    return
            self._poke.wait(max(0.0, self.interval - (time.monotonic() - started)))
            self._poke.clear()

    def poll_now(self) -> None:
        self._poke.set()

    def show(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self._header(snapshot)
        if snapshot.banners != self._banners:  # update() relayouts the screen: only on change
            self._banners = snapshot.banners
            banner = self.query_one("#banner", Static)
            banner.update("\n".join(snapshot.banners))
            banner.display = bool(snapshot.banners)
        for panel in self.query(Panel):
            panel.show(snapshot)
        box = self.query_one("#box", BoxPanel)
        wanted = len(snapshot.instances) > 1 or len(snapshot.gpus) > 1
        if box.display != wanted:
            box.display = wanted
        self._sessions(snapshot)
        self.shown += 1

    def _header(self, snap: Snapshot | None) -> None:
        header = self.query_one("#header", Header)
        if snap is None:
            header.set("kvtier top · waiting for the first sample…")
            return
        counts: dict[str, int] = dict(snap.session_states)  # the server's count of every session
        if not counts or snap.all_sessions:
            counts = {}
            for row in snap.sessions:
                counts[row.state] = counts.get(row.state, 0) + 1
        states = " ".join(f"{counts[state]} {state}" for state in ("hot", "warm", "cold", "pinned", "gone")
                          if counts.get(state))
        server = snap.model or "?" if snap.connected else "no server"
        if snap.instance and len(snap.instances) > 1:
            server = f"[{snap.instance}] {server}" + (" · all instances" if snap.all_sessions else "")
        shown = f"{len(self._rows_all)}/{len(snap.sessions)}" if self.filter else f"{len(snap.sessions)}"
        if snap.sessions_total is not None and snap.sessions_total > len(snap.sessions) and not snap.all_sessions:
            shown += f" most recent of {snap.sessions_total:,}"
        extra = f" · filter '{self.filter}'" if self.filter else ""
        header.set(f"{time.strftime('%H:%M:%S', time.localtime(snap.taken))} {server} │ {shown} sessions: "
                      f"{states or 'none'} │ by {SORTS[self.sort]}{extra}")

    def _rows(self, snap: Snapshot) -> list[SessionRow]:
        rows = list(snap.sessions)
        if self.filter:
            needle = self.filter.lower()
            rows = [r for r in rows if needle == r.state or needle in r.session_id.lower()
                    or needle == (r.instance or "").lower()]
        key = SORTS[self.sort]
        if key == "last use":
            rows.sort(key=lambda r: -r.last_use)
        elif key == "tokens":
            rows.sort(key=lambda r: -r.tokens)
        elif key == "bytes":
            rows.sort(key=lambda r: -(r.bytes_dram + r.bytes_nvme))
        elif key == "session":
            rows.sort(key=lambda r: r.session_id)
        else:
            rows.sort(key=lambda r: (r.state, r.session_id))
        return rows

    @staticmethod
    def _key(row: SessionRow) -> str:
        """A row's identity: the session id, with its instance in the all-instances view (two
        instances may both have an ``agent-1``)."""
        return f"{row.instance}/{row.session_id}" if row.instance else row.session_id

    def _cells(self, row: SessionRow) -> tuple:
        codec = row.codec_dram if row.codec_dram == row.codec_nvme else f"{row.codec_dram}/{row.codec_nvme}"
        return (self._key(row), Text(self._state(row), style=STATE_STYLE.get(row.state, "")), f"{row.tokens:,}",
                human_bytes(row.bytes_hbm) if row.bytes_hbm else "-",
                human_bytes(row.bytes_dram) if row.bytes_dram else "-",
                human_bytes(row.bytes_nvme) if row.bytes_nvme else "-", codec, idle_text(self._idle(row)),
                self._next_turn(row), f"#{row.job}" if row.job else "")

    def _left(self, until: float | None) -> float | None:
        """Seconds from the snapshot to ``until`` (None: no time limit)."""
        return None if until is None else max(0.0, until - (self.snapshot.taken if self.snapshot else time.time()))

    def _state(self, row: SessionRow) -> str:
        """``pinned·dram``, with a timed pin's time left (``pinned·dram 29m``); a live retention hint
        adds ``·kept 5m``."""
        state = row.state + (f"·{row.pinned}" if row.pinned else "")
        if row.pinned and row.pin_expires_at is not None:
            state += f" {idle_text(self._left(row.pin_expires_at))}"
        if row.retain_expires_at is not None:
            state += f"·kept {idle_text(self._left(row.retain_expires_at))}"
        return state

    @staticmethod
    def _next_turn(row: SessionRow) -> str:
        """The cost model's call for the session's next turn: load or split (with the predicted time
        of loading it all) or recompute; "-" until the engine has timed enough prefill."""
        if row.decision is None or row.restore_s is None:
            return "-"
        if row.decision == "recompute":
            return f"recompute {row.recompute_s:.1f}s"
        return f"{row.decision} {row.restore_s:.2f}s"  # load, or split (its front loads)

    def _sessions(self, snap: Snapshot) -> None:
        rows = self._rows(snap)
        self._rows_all = rows
        index = {self._key(r): i for i, r in enumerate(rows)}
        if self._selected in index:
            self._cursor = index[self._selected]
        self._cursor = min(max(self._cursor, 0), max(0, len(rows) - 1))
        self._selected = self._key(rows[self._cursor]) if rows else None
        self._draw_window()

    def move_selection(self, delta: int) -> None:
        if not self._rows_all:
            return
        self._cursor = min(max(self._cursor + delta, 0), len(self._rows_all) - 1)
        self._selected = self._key(self._rows_all[self._cursor])
        self._draw_window()

    def _idle(self, row: SessionRow) -> float:
        return max(0.0, (self.snapshot.taken if self.snapshot else time.time()) - row.last_use)

    def _draw_window(self) -> None:
        """Put the window's rows on screen. Table rows are screen positions (keys "0", "1"...):
        a redraw rewrites the cells that changed, and rows are added or removed only when the
        window's height changes, so a re-sorted list costs no layout pass."""
        table = self.query_one("#sessions", SessionTable)
        height = table.visible_rows()
        if self._cursor < self._top:
            self._top = self._cursor
        elif self._cursor >= self._top + height:
            self._top = self._cursor - height + 1
        self._top = max(0, min(self._top, max(0, len(self._rows_all) - height)))
        window = self._rows_all[self._top:self._top + height]
        cells = [self._cells(r) for r in window]
        while table.row_count > len(cells):
            table.remove_row(str(table.row_count - 1))
        for position, new in enumerate(cells):
            if position >= table.row_count:
                table.add_row(*new, key=str(position))
                continue
            old = self._drawn[position]
            if old != new:
                for (column, _), a, b in zip(COLUMNS, old, new):
                    if a != b:
                        table.update_cell(str(position), column, b)
        self._keys = [self._key(r) for r in window]
        self._drawn = cells
        if cells:
            row = self._cursor - self._top
            if table.cursor_row != row:
                table.move_cursor(row=row, animate=False)

    def redraw_sessions(self) -> None:
        if self.snapshot is not None:
            self._draw_window()

    def select_position(self, position: int) -> None:
        """A click on the table's ``position``-th row."""
        if 0 <= position < len(self._keys):
            self.move_selection(self._top + position - self._cursor)

    def selected_session(self) -> str | None:
        row = self._row(self._selected) if self._selected else None
        return row.session_id if row is not None else self._selected

    def _row(self, key: str) -> SessionRow | None:
        if self.snapshot is None:
            return None
        return next((r for r in self.snapshot.sessions if self._key(r) == key), None)

    def _client_for(self, session: str | None = None):
        """The admin client of the selected row's instance (the shown one's outside the all view)."""
        if self.box is None:
            return self.client
        row = self._row(self._selected) if self._selected else None
        return self.box.client(row.instance if row is not None and row.instance else None)

    # ---- actions -------------------------------------------------------------------------------
    def _need_session(self) -> str | None:
        session = self.selected_session()
        if session is None:
            self.notify("no session selected", severity="warning")
        elif self._client_for() is None:
            self.notify("replaying a recording: read-only", severity="warning")
            return None
        return session

    def _post(self, label: str, path: str, body: dict, send=None) -> None:
        """Send a write in a thread; report the job, follow it in the jobs panel. ``send(client)``
        replaces the plain POST (a file handed over the socket)."""
        client = self._client_for()

        def run() -> None:
            try:
                job = send(client) if send is not None else client.post(path, body)
                message, severity = f"{label}: job #{job['id']} {job['state']}", "information"
            except KvtierError as exc:
                message = f"{label}: {exc.message}" + (f"\nhint: {exc.hint}" if exc.hint else "")
                severity = "error"
            try:
                self.call_from_thread(self.notify, message, severity=severity, timeout=4)
            except RuntimeError:
                return
            self.poll_now()

        self.run_worker(run, thread=True, group="actions")

    def action_pin(self) -> None:
        session = self._need_session()
        if session is None:
            return
        row = self._row(session)
        if row is not None and row.pinned:
            self._post(f"unpin {session}", AdminClient.session_path(session, "unpin"), {})
            return

        def chosen(tier: str | None) -> None:
            if tier:
                self._post(f"pin {session} to {tier}", AdminClient.session_path(session, "pin"), {"tier": tier})

        self.push_screen(Choice(f"pin {session} to:", {"d": ("dram", "DRAM (never demoted)"),
                                                        "n": ("nvme", "NVMe (never dropped)")}), chosen)

    def action_evict(self) -> None:
        session = self._need_session()
        if session is None:
            return

        def confirmed(yes: str | None) -> None:
            if yes == "yes":
                self._post(f"drop {session}", AdminClient.session_path(session, "evict"), {"to": "drop"})

        def chosen(to: str | None) -> None:
            if to == "drop":
                self.push_screen(Choice(f"drop every block of {session}? It will need a full prefill.",
                                        {"y": ("yes", "yes, drop it"), "n": ("no", "no")}), confirmed)
            elif to:
                self._post(f"evict {session} to {to}", AdminClient.session_path(session, "evict"), {"to": to})

        self.push_screen(Choice(f"evict {session}:", {"d": ("dram", "to DRAM (off the NVMe-only path)"),
                                                      "n": ("nvme", "to NVMe (frees DRAM)"),
                                                      "x": ("drop", "drop (asks to confirm)")}), chosen)

    def action_snapshot(self) -> None:
        session = self._need_session()
        if session is None:
            return
        default = f"{self.snapshot.snapshot_dir}/{session}.kvsnap" if self.snapshot and self.snapshot.snapshot_dir \
            else ""

        def given(path: str | None) -> None:
            if path is None:
                return
            target = path.strip()
            if not target or target == default:
                self._post(f"snapshot {session}", AdminClient.session_path(session, "snapshot"), {})
                return
            # anywhere else: the file is made here and handed over (the server writes only that file)
            self._post(f"snapshot {session}", "", {}, send=lambda client: client.snapshot_to_file(session, target))

        self.push_screen(Ask(f"snapshot {session} to:", default), given)

    def action_restore(self) -> None:
        if self._client_for() is None:
            self.notify("replaying a recording: read-only", severity="warning")
            return
        session = self.selected_session()
        default = ""
        if self.snapshot and self.snapshot.snapshot_dir and session:
            default = f"{self.snapshot.snapshot_dir}/{session}.kvsnap"

        def given(path: str | None) -> None:
            if path and path.strip():
                source = path.strip()
                self._post(f"restore {source}", "/v1/restore", {}, send=lambda client: client.restore_file(source))

        self.push_screen(Ask("restore the session in snapshot file:", default), given)

    def action_filter(self) -> None:
        def given(value: str | None) -> None:
            if value is not None:
                self.filter = value.strip()
                if self.snapshot is not None:
                    self._sessions(self.snapshot)
                    self._header(self.snapshot)

        self.push_screen(Ask("filter sessions (id part or state; empty: all):", self.filter), given)

    def action_sort(self) -> None:
        self.sort = (self.sort + 1) % len(SORTS)
        if self.snapshot is not None:
            self._sessions(self.snapshot)
            self._header(self.snapshot)

    def _turns(self, row: SessionRow) -> list[str]:
        """The session's last turns and why each recomputed what it did (``kvtier inspect``'s lines),
        asked of its server when the details open; nothing when replaying."""
        client = self._client_for()
        if client is None:
            return []
        try:
            turns = client.get(AdminClient.session_path(row.session_id)).get("turns") or []
        except KvtierError as exc:
            return ["", f"last turns: not available ({exc.message})"]
        if not turns:
            return ["", "last turns: none since the server started"]
        from kvtier.plan.reasons import format_turn

        return ["", "last turns (why each recomputed what it did):"] + [f"  {format_turn(t)}" for t in turns[-5:]]

    def action_next_instance(self) -> None:
        if self.box is None or len(self.box.names()) < 2:
            self.notify("one kvtier instance on this box", severity="information")
            return
        self.notify(f"instance {self.box.cycle()}", timeout=2)
        self.poll_now()

    def action_all_instances(self) -> None:
        if self.box is None:
            self.notify("one kvtier instance (started with --socket)", severity="information")
            return
        self.box.all_sessions = not self.box.all_sessions
        self.poll_now()

    def action_help(self) -> None:
        self.push_screen(Page("kvtier top: keys", HELP))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        position = int(event.row_key.value) if event.row_key is not None else -1
        session = self._keys[position] if 0 <= position < len(self._keys) else None
        row = self._row(session) if session else None
        if row is None:
            return
        pin_left = self._left(row.pin_expires_at) if row.pinned else None
        pinned = f" (pinned to {row.pinned}" + (f", for {human_duration(pin_left)} more" if pin_left is not None
                                                else "") + ")" if row.pinned else ""
        lines = [f"{'state':<12}{row.state}{pinned}",
                 f"{'tokens':<12}{row.tokens:,} in {row.blocks:,} blocks",
                 f"{'HBM':<12}" + (f"{human_bytes(row.bytes_hbm)} in vLLM's prefix cache" if row.bytes_hbm is not None
                                   else "not known (vLLM publishes no KV cache events)"),
                 f"{'DRAM':<12}{row.blocks_dram:,} blocks, {human_bytes(row.bytes_dram)} ({row.codec_dram})",
                 f"{'NVMe':<12}{row.blocks_nvme:,} blocks, {human_bytes(row.bytes_nvme)} ({row.codec_nvme})",
                 f"{'last use':<12}{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(row.last_use))}"
                 f" ({idle_text(self._idle(row))} ago)",
                 f"{'next turn':<12}" + (f"restore {row.restore_s:.3f} s vs recompute {row.recompute_s:.3f} s: "
                                         f"{row.decision}" if row.restore_s is not None else
                                         "no cost model yet (the engine has not timed enough prefill)"),
                 f"{'job':<12}{'#' + str(row.job) if row.job else 'none in flight'}"]
        if row.stored_note:
            lines.append(f"{'stored':<12}{row.stored_note}")
        if row.retain_expires_at is not None:
            lines.append(f"{'retained':<12}{human_duration(self._left(row.retain_expires_at))} more, priority "
                         f"{row.retain_priority} (a request's hint: its blocks leave their tier last)")
        if row.instance:
            lines.append(f"{'instance':<12}{row.instance}")
        lines += self._turns(row)
        jobs = [j for j in (self.snapshot.jobs if self.snapshot else ()) if j.session_id == row.session_id][:5]
        if jobs:
            lines += ["", "recent jobs:"] + [f"  #{j.id} {j.kind} {j.state} {human_bytes(j.bytes)}" for j in jobs]
        self.push_screen(Page(f"session {session}", "\n".join(lines)))
