"""The pieces ``kvtier top`` is made of: the panels (header, tiers, box, links, jobs), the session
table, the modal questions, and the small formatters they share. Each renders the latest
``Snapshot`` it was given and nothing else."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Static

from kvtier.tui.model import Snapshot
from kvtier.units import human_bytes

__all__ = ["short_bytes", "human_rate", "idle_text", "spark", "Panel", "Header", "TiersPanel", "BoxPanel",
           "LinksPanel", "JobsPanel", "SessionTable", "Choice", "Ask", "Page", "SPARKS", "SORTS", "STATE_STYLE",
           "COLUMNS", "HELP", "TIER_LABELS"]


SPARKS = "▁▂▃▄▅▆▇█"
SORTS = ("last use", "tokens", "bytes", "session", "state")
STATE_STYLE = {"hot": "bold red", "warm": "yellow", "cold": "cyan", "pinned": "bold magenta", "gone": "dim"}
COLUMNS = (("session", "session"), ("state", "state"), ("tokens", "tokens"), ("hbm", "HBM"), ("dram", "DRAM"),
           ("nvme", "NVMe"), ("codec", "codec"), ("idle", "idle"), ("next", "next turn"), ("job", "job"))
HELP = """\
 p      pin the selected session (to DRAM or NVMe), or unpin it
 e      evict: to DRAM, to NVMe, or drop (asks to confirm)
 s      snapshot the session to a file (default: the snapshot dir)
 r      restore a session from a snapshot file
 /      filter: part of a session id, or a state (hot warm cold
        pinned gone); empty shows all
 o      change the sort order
 i      next kvtier instance (when several run on the box)
 a      all instances' sessions in one list, or the shown one's
 ↑↓ PgUp PgDn Home End   move;   enter   session details
 ?      this help;   q   quit

Bars: HBM is vLLM's KV cache (blocks held by running requests),
DRAM kvtier's pinned pool, NVMe its block store. Hits: share of
prompt tokens each tier served since the server started. Links:
kvtier's byte counters; PCIe from NVML; disk from the host.
"""


def short_bytes(n: float | None) -> str:
    """Four or five characters: 13.3M, 1.0G, 512K."""
    if n is None:
        return "N/A"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" or n >= 100 else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"  # pragma: no cover


def human_rate(n: float | None) -> str:
    return "N/A" if n is None else human_bytes(n) + "/s"


def idle_text(seconds: float) -> str:
    """Coarse on purpose: a column that changes every second for every row costs redraws."""
    if seconds < 60:
        return "<1m"
    if seconds < 3600:
        return f"{int(seconds // 60)}m"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h"
    return f"{int(seconds // 86400)}d"


def spark(history: tuple[float, ...], width: int) -> str:
    values = history[-width:]
    if not values:
        return " " * width
    top = max(values) or 1.0
    line = "".join(SPARKS[min(7, int(v / top * 7.999))] if v > 0 else " " for v in values)
    return line.rjust(width)


# ---- panels -------------------------------------------------------------------------------------
class Panel(Static):
    snapshot: Snapshot | None = None

    def show(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.refresh()


class Header(Static):
    """One line; redrawn without a layout pass (``Static.update`` relayouts the screen)."""

    line = ""

    def set(self, line: str) -> None:
        if line != self.line:
            self.line = line
            self.refresh()

    def render(self) -> str:
        return self.line


TIER_LABELS = {"shared": "SHRD"}  # the tier column is 5 wide


class TiersPanel(Panel):
    def render(self) -> Text:
        snap = self.snapshot
        text = Text("Tiers\n", style="bold")
        if snap is None or not snap.tiers:
            return text + Text("N/A (no server)", style="dim")
        width = max(10, self.size.width)
        bar_width = max(4, width - 5 - 5 - 12 - 9)  # name, percent, used/capacity, codec
        for tier in snap.tiers:
            fraction = tier.fraction
            text.append(f"{TIER_LABELS.get(tier.name, tier.name.upper()):<5}")
            if fraction is None:
                text.append("━" * bar_width, style="dim")
                text.append("  N/A")
            else:
                filled = int(round(fraction * bar_width))
                style = "red" if fraction > 0.9 else "yellow" if fraction > 0.75 else "green"
                text.append("━" * filled, style=style)
                text.append("━" * (bar_width - filled), style="dim")
                text.append(f" {fraction * 100:3.0f}%")
            used = f"{short_bytes(tier.used_bytes)}/{short_bytes(tier.capacity_bytes)}"
            text.append(f" {used:>11}")
            text.append(f" {tier.codec[:8]:<8}\n", style="dim")
        hits = "  ".join(f"{TIER_LABELS.get(name, name.upper())} {'N/A' if rate is None else f'{rate * 100:.0f}%'}"
                         for name, rate in snap.hit_rates)
        text.append("hits ", style="bold")
        text.append(hits or "N/A")
        if snap.dirty_bytes is not None:  # what a crash would lose: DRAM blocks not yet on NVMe
            text.append("  not on NVMe ", style="bold")
            age = f" {snap.dirty_age_s:.0f}s" if snap.dirty_bytes and snap.dirty_age_s is not None else ""
            text.append(f"{short_bytes(snap.dirty_bytes)}{age}",
                        style="yellow" if snap.dirty_bytes and (snap.dirty_age_s or 0) > 30 else "")
        return text


class BoxPanel(Panel):
    """The box when it runs several instances or has several GPUs: one line per instance (its
    GPUs, DRAM and NVMe tiers, sessions), one per GPU (HBM, PCIe, who uses it)."""

    def render(self) -> Text:
        snap = self.snapshot
        text = Text("Box\n", style="bold")
        if snap is None:
            return text
        for inst in snap.instances:
            mark = "▶ " if inst.name == snap.instance else "  "
            gpus = "all GPUs" if inst.gpus is None else ("GPU " + ",".join(inst.gpus) if inst.gpus else "no GPU")
            state = "" if inst.connected else "  (not answering)"
            text.append(f"{mark}{inst.name:<10}", style="bold" if mark.strip() else "")
            text.append(f" :{inst.port:<5} {inst.model[:24]:<24} {gpus:<10} "
                        f"DRAM {short_bytes(inst.dram_used)}/{short_bytes(inst.dram_capacity)}  "
                        f"NVMe {short_bytes(inst.nvme_used)}/{short_bytes(inst.nvme_capacity)}  "
                        f"{inst.sessions} sessions{state}\n")
        for gpu in snap.gpus:
            hbm = f"{short_bytes(gpu.hbm_used)}/{short_bytes(gpu.hbm_total)}"
            users = ",".join(gpu.instances) or "-"
            text.append(f"  GPU{gpu.index} {gpu.name[:20]:<20} HBM {hbm:>11}  PCIe ↓{human_rate(gpu.pcie_to_gpu)} "
                        f"↑{human_rate(gpu.pcie_from_gpu)}  {users}\n")
        return text


class LinksPanel(Panel):
    def render(self) -> Text:
        snap = self.snapshot
        text = Text("Links", style="bold")
        text.append("  (kvtier, NVML, host disk)\n", style="dim")
        if snap is None:
            return text
        rows = self._rows(snap)
        width = max(10, self.size.width)
        spark_width = max(4, width - 24)
        for name, rate, history in rows:
            text.append(f"{name:<11}")
            text.append(spark(history, spark_width), style="cyan")
            text.append(f" {human_rate(rate):>11}\n", style="dim" if rate is None else "")
        return text

    def _rows(self, snap: Snapshot) -> list[tuple[str, float | None, tuple[float, ...]]]:
        links = {link.name: link for link in snap.links}
        if self.size.height >= len(snap.links) + 1:  # room for every link
            return [(link.name, link.bytes_per_s, link.history) for link in snap.links]
        # compact: six rows, NVMe and disk traffic summed
        def total(names: tuple[str, ...]) -> tuple[float | None, tuple[float, ...]]:
            chosen = [links[n] for n in names if n in links]
            rates = [link.bytes_per_s for link in chosen if link.bytes_per_s is not None]
            length = max((len(link.history) for link in chosen), default=0)
            history = tuple(sum(link.history[i - length + len(link.history)] for link in chosen
                                if i - length + len(link.history) >= 0) for i in range(length))
            return (sum(rates) if rates else None), history

        out = []
        pcie: tuple = (("PCIe →GPU", ("PCIe →GPU",)), ("PCIe GPU→", ("PCIe GPU→",)))
        if "shared→DRAM" in links:  # still six rows: PCIe's two directions share one
            pcie = (("PCIe r+w", ("PCIe →GPU", "PCIe GPU→")), ("shared r+w", ("shared→DRAM", "DRAM→shared")))
        for label, names in (*pcie, ("DRAM→HBM", ("DRAM→HBM",)), ("HBM→DRAM", ("HBM→DRAM",)),
                             ("NVMe r+w", ("DRAM→NVMe", "NVMe→DRAM", "snapshot", "restore")),
                             ("disk r+w", ("disk read", "disk write"))):
            rate, history = total(names)
            out.append((label, rate, history))
        return out


class JobsPanel(Panel):
    def render(self) -> Text:
        snap = self.snapshot
        text = Text()
        if snap is None or not snap.jobs:
            return Text("jobs: none yet", style="dim")
        for job in snap.jobs[: max(1, self.size.height)]:
            style = {"failed": "red", "done": "green"}.get(job.state, "yellow")
            text.append(f"#{job.id:<4} {job.kind:<8} {str(job.session_id or '-')[:20]:<20} ")
            text.append(f"{job.state:<7}", style=style)
            done = job.state in ("done", "failed")
            text.append(f" {human_bytes(job.bytes) if done else '…':>9}")
            if job.seconds is not None:
                text.append(f" {job.seconds:.2f}s")
            if job.error:
                text.append(f" {job.error[:60]}", style="red")
            text.append("\n")
        text.rstrip()
        return text


class SessionTable(DataTable):
    """A window onto the sorted session list: it holds only the rows on screen (a thousand rows
    rebuilt every second were most of top's CPU), and moving past its edges scrolls the window."""

    def action_cursor_up(self) -> None:
        self.app.move_selection(-1)

    def action_cursor_down(self) -> None:
        self.app.move_selection(1)

    def action_page_up(self) -> None:
        self.app.move_selection(-max(1, self.visible_rows() - 1))

    def action_page_down(self) -> None:
        self.app.move_selection(max(1, self.visible_rows() - 1))

    def action_scroll_top(self) -> None:
        self.app.move_selection(-10**9)

    action_scroll_home = action_scroll_top

    def action_scroll_bottom(self) -> None:
        self.app.move_selection(10**9)

    action_scroll_end = action_scroll_bottom

    def on_mouse_scroll_down(self, event) -> None:
        event.stop()
        self.app.move_selection(3)

    def on_mouse_scroll_up(self, event) -> None:
        event.stop()
        self.app.move_selection(-3)

    def visible_rows(self) -> int:
        return max(1, self.size.height - 1)  # minus the header

    def on_resize(self, event) -> None:
        self.app.redraw_sessions()  # the window's height is the table's

    def on_click(self, event) -> None:
        if event.y >= 1:  # below the header: select that row (the table itself holds no more)
            self.app.select_position(event.y - 1)


# ---- modal screens ------------------------------------------------------------------------------
class Choice(ModalScreen):
    """A one-key choice: ``options`` maps a key to (value, label); escape cancels."""

    DEFAULT_CSS = "Choice { align: center middle; } Choice > Static { width: auto; max-width: 70; " \
                  "border: round $accent; padding: 0 2; background: $panel; }"

    def __init__(self, title: str, options: dict[str, tuple[str, str]]):
        super().__init__()
        self.title_text, self.options = title, options

    def compose(self) -> ComposeResult:
        lines = [self.title_text, ""] + [f" [{key}] {label}" for key, (_, label) in self.options.items()]
        yield Static("\n".join(lines + ["", " [esc] cancel"]))

    def on_key(self, event) -> None:
        event.stop()
        if event.key in self.options:
            self.dismiss(self.options[event.key][0])
        elif event.key in ("escape", "q"):
            self.dismiss(None)


class Ask(ModalScreen):
    """A line of text (a path, a filter): enter accepts, escape cancels."""

    DEFAULT_CSS = "Ask { align: center middle; } Ask > Vertical { width: 72; height: auto; " \
                  "border: round $accent; background: $panel; padding: 0 1; }"

    def __init__(self, prompt: str, value: str = ""):
        super().__init__()
        self.prompt, self.value = prompt, value

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.prompt + "  (enter: ok, esc: cancel)")
            yield Input(value=self.value, id="ask")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value)

    def on_key(self, event) -> None:
        if event.key == "escape":
            event.stop()
            self.dismiss(None)


class Page(ModalScreen):
    """Read-only text (help, session details); any of escape, q, enter, ? closes it."""

    DEFAULT_CSS = "Page { align: center middle; } Page > Static { width: auto; max-width: 78; height: auto; " \
                  "max-height: 95%; border: round $accent; padding: 0 1; background: $panel; }"

    def __init__(self, title: str, body: str):
        super().__init__()
        self.title_text, self.body = title, body

    def compose(self) -> ComposeResult:
        yield Static(Text(self.title_text + "\n\n", style="bold") + Text(self.body))

    def on_key(self, event) -> None:
        event.stop()
        if event.key in ("escape", "q", "enter", "question_mark"):
            self.dismiss(None)
