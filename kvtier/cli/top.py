"""``kvtier top``: the live dashboard (Textual, imported only when the command runs)."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import typer

from kvtier.cli.admin import INSTANCE_OPTION, selected_instance
from kvtier.cli.output import emit_json, handle_errors, print_table
from kvtier.errors import UsageError

__all__ = ["register", "top"]


class _Feed(NamedTuple):
    """Where the dashboard's snapshots come from: ``source()`` gives the next (None: no more), ``first`` is
    one already read (a recording's), ``client`` acts on the server, ``box`` watches every instance."""

    source: Callable[[], Any]
    first: Any = None
    client: Any = None
    box: Any = None


@handle_errors
def top(
    socket: Optional[str] = typer.Option(None, "--socket",
                                         help="Admin socket (default: the only running instance's)."),
    _instance: Optional[str] = INSTANCE_OPTION,
    interval: float = typer.Option(1.0, "--interval", min=0.1, max=60.0, help="Seconds between samples."),
    once: bool = typer.Option(False, "--once", help="Print one sample and exit (no TTY needed)."),
    json_out: bool = typer.Option(False, "--json", help="With --once: the sample as JSON."),
    record: Optional[Path] = typer.Option(None, "--record", help="Append every sample to FILE (JSON lines)."),
    replay: Optional[Path] = typer.Option(None, "--replay", help="Show a recording instead of a live server."),
    all_sessions: bool = typer.Option(False, "--all", help="Every instance's sessions in one list (key a)."),
) -> None:
    """Live dashboard: tier occupancy, link throughput, hit rates, sessions and jobs, with keys to act.
    With several instances on the box it shows them all (HBM and PCIe per GPU); i switches."""
    if json_out and not once:
        raise UsageError("--json needs --once", hint="kvtier top --once --json")
    if replay is not None and record is not None:
        raise UsageError("--record and --replay do not go together", hint="record a live server, replay the file")
    recorder = _recorder(record) if record is not None else None
    feed = _replay_feed(replay) if replay is not None else _live_feed(socket, all_sessions)
    if once:
        snapshot = feed.first
        if snapshot is None:
            feed.source()  # counters' first sample: rates need two
            time.sleep(min(interval, 1.0))
            snapshot = feed.source()
        if recorder is not None:
            recorder(snapshot)
        _print_once(snapshot, json_out)
        return
    if not sys.stdout.isatty():
        raise UsageError("kvtier top needs a terminal", hint="use `kvtier top --once [--json]` in scripts")
    from kvtier.tui.app import TopApp

    TopApp(feed.source, interval=interval, client=feed.client, record=recorder, first=feed.first,
           box=feed.box).run()


def register(app: typer.Typer) -> None:
    app.command("top")(top)


def _recorder(record: Path) -> Callable[[Any], None]:
    """Appends every snapshot to ``record`` as one JSON line (flushed: a killed dashboard loses none)."""
    try:
        handle = open(record, "a", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {record}: {exc.strerror}", hint="choose a writable path") from None

    def recorder(snapshot) -> None:
        handle.write(snapshot.to_json() + "\n")
        handle.flush()

    return recorder


def _replay_feed(replay: Path) -> _Feed:
    from kvtier.tui.collector import replay as read_recording

    snapshots = read_recording(str(replay))
    first = next(snapshots, None)
    if first is None:
        raise UsageError(f"{replay} holds no snapshots", hint="record one with `kvtier top --record FILE`")
    return _Feed(lambda: next(snapshots, None), first)


def _live_feed(socket: Optional[str], all_sessions: bool) -> _Feed:
    """One server when a socket or URL is given (or nothing is registered), else every instance on the box."""
    import os

    from kvtier.control.client import connect
    from kvtier.control.instances import find_instance, list_instances

    chosen = selected_instance() or os.environ.get("KVTIER_INSTANCE")
    direct = socket or os.environ.get("KVTIER_ADMIN_SOCKET") or os.environ.get("KVTIER_ADMIN_URL")
    if not direct and (list_instances() or chosen):
        if chosen:
            find_instance(chosen)  # a name nothing runs under: the usual error, listing what runs
        from kvtier.tui.collector import BoxCollector

        box = BoxCollector()
        box.select(chosen)
        box.all_sessions = all_sessions
        return _Feed(box.poll, client=box.client(None), box=box)
    from kvtier.tui.collector import Collector

    client = connect(socket, selected_instance())
    return _Feed(Collector(client).poll, client=client)


def _print_once(snapshot, json_out: bool) -> None:
    from dataclasses import asdict

    from kvtier.tui.widgets import human_rate, idle_text
    from kvtier.units import human_bytes

    if json_out:
        emit_json(asdict(snapshot))
        return
    for banner in snapshot.banners:
        typer.echo(f"note: {banner}", err=True)
    if len(snapshot.instances) > 1 or len(snapshot.gpus) > 1:
        print_table("instances on this box", ["instance", "port", "model", "GPUs", "DRAM", "NVMe", "sessions"],
                    [(("▶ " if i.name == snapshot.instance else "") + i.name, i.port, i.model,
                      "all" if i.gpus is None else ",".join(i.gpus) or "-",
                      f"{human_bytes(i.dram_used)}/{human_bytes(i.dram_capacity)}",
                      f"{human_bytes(i.nvme_used)}/{human_bytes(i.nvme_capacity)}",
                      i.sessions if i.connected else "not answering") for i in snapshot.instances])
        if snapshot.gpus:
            print_table("GPUs", ["GPU", "name", "HBM", "PCIe →GPU", "PCIe GPU→", "instances"],
                        [(g.index, g.name, f"{human_bytes(g.hbm_used)}/{human_bytes(g.hbm_total)}",
                          human_rate(g.pcie_to_gpu), human_rate(g.pcie_from_gpu), ",".join(g.instances) or "-")
                         for g in snapshot.gpus])
    print_table("tiers", ["tier", "used", "capacity", "%", "codec"],
                [(t.name, human_bytes(t.used_bytes), human_bytes(t.capacity_bytes),
                  "N/A" if t.fraction is None else f"{t.fraction * 100:.0f}%", t.codec) for t in snapshot.tiers])
    print_table("hit rates (share of prompt tokens)", ["tier", "hits"],
                [(name, "N/A" if rate is None else f"{rate * 100:.1f}%") for name, rate in snapshot.hit_rates])
    print_table("links", ["link", "rate", "source"],
                [(link.name, human_rate(link.bytes_per_s), link.source) for link in snapshot.links])
    rows = sorted(snapshot.sessions, key=lambda r: -r.last_use)[:20]
    shown = f" of instance {snapshot.instance}" if snapshot.instance and len(snapshot.instances) > 1 else ""
    print_table(f"sessions{shown} ({len(snapshot.sessions)}, most recent first)",
                ["session", "state", "tokens", "DRAM", "NVMe", "idle"],
                [(f"{r.instance}/{r.session_id}" if r.instance else r.session_id, r.state, f"{r.tokens:,}",
                  human_bytes(r.bytes_dram), human_bytes(r.bytes_nvme),
                  idle_text(snapshot.taken - r.last_use)) for r in rows])
