"""The session commands: clients of the admin API of a running ``kvtier serve``.

``status``, ``sessions``, ``inspect``, ``pin``, ``unpin``, ``evict``, ``snapshot SESSION``,
``restore FILE``, ``flush``, ``jobs``. Reads take ``--json``; writes wait for their job with a progress
spinner unless ``--no-wait`` (then they print the job id). The socket is found without flags
(``$KVTIER_ADMIN_SOCKET``, else the one ``kvtier serve`` prints); ``--socket`` overrides it.
"""
from __future__ import annotations

import time
from typing import Optional

import typer

from kvtier.cli.output import emit_json, handle_errors, human_bytes, print_table

__all__ = ["INSTANCE_OPTION", "register", "selected_instance", "status", "sessions", "inspect", "jobs", "pin", "unpin",
           "evict", "snapshot_take", "restore", "flush"]

SOCKET_HELP = "Admin socket of the server (default: the only running instance's)."


_SELECTED: list[Optional[str]] = [None]


def remember_instance(value: Optional[str]) -> Optional[str]:
    """``--instance NAME|PORT``, kept for the client this command makes (click calls this for
    every command that has the option, with None when it is absent)."""
    _SELECTED[0] = value
    return value


def selected_instance() -> Optional[str]:
    return _SELECTED[0]


INSTANCE_OPTION = typer.Option(None, "--instance", callback=remember_instance, expose_value=False,
                               help="Which kvtier serve, by name or port, when several run (kvtier instances).")


def _client(socket: Optional[str]):
    from kvtier.control.client import connect

    return connect(socket, selected_instance())


def _ago(ts: float) -> str:
    seconds = max(0.0, time.time() - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _finish(client, job: dict, wait: bool, json_out: bool, label: str) -> None:
    if wait and job["state"] not in ("done", "failed"):
        from rich.console import Console

        console = Console(stderr=True)
        with console.status(f"{label} (job {job['id']})…"):
            job = client.wait(job)
    if json_out:
        emit_json(job)
    elif job["state"] == "failed":
        from kvtier.errors import KvtierError

        raise KvtierError(f"{label}: job {job['id']} failed: {job.get('error')}",
                          hint=f"details: kvtier jobs {job['id']}")
    elif job["state"] == "done":
        extra = f", {human_bytes(job['bytes'])} moved" if job.get("bytes") else ""
        where = f" -> {job['path']}" if job.get("path") else ""
        typer.echo(f"{label}: done (job {job['id']}{extra}){where}")
    else:
        typer.echo(f"{label}: job {job['id']} {job['state']} (follow it with `kvtier jobs {job['id']}`)")
    if job["state"] == "failed":
        raise typer.Exit(1)


# ---- reads ---------------------------------------------------------------------------------------
@handle_errors
def status(json_out: bool = typer.Option(False, "--json", help="Print JSON."),
           socket: Optional[str] = typer.Option(None, "--socket", help=SOCKET_HELP),
           _instance: Optional[str] = INSTANCE_OPTION) -> None:
    """The server: model, tiers (bytes, codec, tokens per GiB), sessions, jobs, warnings."""
    doc = _client(socket).get("/v1/status")
    if json_out:
        emit_json(doc)
        return
    typer.echo(_status_headline(doc))
    print_table("tiers", ["tier", "used", "%", "blocks", "codec", "tokens/GiB"],
                [_tier_row(tier, doc["tiers"][tier]) for tier in ("hbm", "dram", "nvme")])
    typer.echo(_hbm_line(doc["tiers"]["hbm"]))
    by_state = ", ".join(f"{n} {state}" for state, n in doc["sessions"].items() if n) or "none"
    typer.echo(f"sessions: {by_state}; jobs in flight: {doc['jobs_in_flight']}")
    for line in _durability_lines(doc):
        typer.echo(line)
    if doc.get("shared"):
        typer.echo(_shared_line(doc["shared"]))
    for tier, warning in doc.get("warnings", {}).items():
        typer.echo(f"warning ({tier}): {warning}", err=True)


def _status_headline(doc: dict) -> str:
    weights = (doc.get("fingerprint") or {}).get("weights") or "-"
    revision = doc.get("revision") or (doc.get("commit") and "")
    if doc.get("commit"):
        revision = f"{revision} ({doc['commit'][:12]})".strip()
    vllm = doc.get("vllm") or {}
    engine = f"  vLLM {vllm['version']}" + ("" if vllm.get("tested") else f" ({vllm.get('status')})") \
        if vllm.get("version") else ""
    return (f"instance {doc.get('instance') or '-'}  model {doc.get('model')}{engine}"
            + (f"  revision {revision}" if revision else "")
            + f"  weights {weights}  KV {doc.get('kv_dtype')}  API {doc.get('api_url') or '-'}  "
              f"up {doc['uptime_s']:.0f}s")


def _hbm_line(hbm: dict) -> str:
    """What the HBM row counts: running requests' blocks, and those vLLM keeps as prefix cache."""
    running = hbm.get("running_blocks")
    if running is None:
        return "HBM: not known"
    if hbm.get("cached_blocks") is None:
        return (f"HBM: {running:,} blocks held by running requests (vLLM publishes no KV cache events, so its "
                f"prefix cache is not counted; kvtier serve turns them on)")
    return (f"HBM: {running:,} blocks held by running requests, {hbm['reclaimable_blocks']:,} more kept by vLLM's "
            f"prefix cache (reusable by the next turn, reclaimed first when vLLM needs room)")


def _tier_row(tier: str, t: dict) -> tuple:
    if tier == "hbm":  # vLLM's KV cache: blocks running requests hold, of its capacity
        used, cap = t.get("used_bytes"), t.get("capacity_bytes")
        known = used is not None and cap
        return (tier, f"{human_bytes(used)} / {human_bytes(cap)}" if known else "-",
                f"{100 * used / cap:.0f}%" if known else "-",
                f"{t['blocks']:,}" if t.get("blocks") is not None else "-",
                t.get("kv_dtype", "-"), f"{t['tokens_per_gib']:,}")
    cap = t["capacity_bytes"]
    pct = f"{100 * t['used_bytes'] / cap:.0f}%" if cap else "-"
    return (tier, f"{human_bytes(t['used_bytes'])} / {human_bytes(cap)}", pct, f"{t['blocks']:,}",
            t.get("codec", "none"), f"{t['tokens_per_gib']:,}")


def _durability_lines(doc: dict) -> list[str]:
    """What a crash would lose (DRAM blocks with no NVMe copy yet) and the catalog read back at start."""
    lines = []
    dirty = doc.get("dirty") or {}
    if dirty.get("dirty_blocks"):
        lines.append(f"not yet on NVMe: {human_bytes(dirty['dirty_bytes'])} in {dirty['dirty_blocks']:,} blocks, "
                     f"oldest {dirty['dirty_age_s']:.1f}s (a crash would lose them; `kvtier flush` writes them now)")
    elif doc["tiers"]["nvme"].get("capacity_bytes"):
        lines.append("not yet on NVMe: nothing (every DRAM block has an NVMe copy)")
    drives = doc.get("nvme_drives") or []
    if len(drives) > 1:
        lines.append(f"NVMe drives: {', '.join(drives)} (blocks placed by key hash; a restore reads all at once)")
    catalog = doc.get("catalog")
    if catalog:
        lines.append(f"session catalog: {catalog['path']} ({catalog['sessions_at_start']:,} sessions read back "
                     f"at start in {catalog['start_ms']} ms)")
    return lines


def _shared_line(shared: dict) -> str:
    link = shared.get("link")
    server = shared.get("server") or {}
    cluster = " (cluster)" if shared.get("cluster") else ""
    return (f"shared tier: {shared['url']}{cluster} {shared['state']}, "
            f"{shared['policy']}, codec {shared['codec']}; "
            + (f"link {link['gbps']:.2f} GB/s, {link['rtt_ms']:.2f} ms round trip; " if link else "")
            + (f"store holds {human_bytes(server.get('used_memory', 0))}"
               + (f" of {human_bytes(server['maxmemory'])}" if server.get("maxmemory") else "") + "; "
               if server else "")
            + f"published {shared['published_blocks']:,} blocks, fetched {shared['fetched_blocks']:,}, "
              f"rejected {shared['rejected']:,}")


@handle_errors
def sessions(
    sort: str = typer.Option("last_use", "--sort", help="last_use, tokens, bytes, session_id or state."),
    state: Optional[str] = typer.Option(None, "--state", help="Only hot, warm, cold, pinned or gone."),
    limit: int = typer.Option(50, "--limit", min=1, max=100_000, help="At most this many rows."),
    shared: bool = typer.Option(False, "--shared", help="The sessions the boxes sharing the store published "
                                                        "(restore one here with kvtier restore --shared)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    socket: Optional[str] = typer.Option(None, "--socket", help=SOCKET_HELP),
    _instance: Optional[str] = INSTANCE_OPTION,
) -> None:
    """Sessions with their state and bytes per tier."""
    if shared:
        _shared_sessions(_client(socket).get("/v1/shared/sessions", limit=limit), json_out)
        return
    doc = _client(socket).get("/v1/sessions", sort=sort, state=state, limit=limit)
    if json_out:
        emit_json(doc)
        return
    rows = [(s["session_id"], s["state"] + (" (partial)" if s.get("blocks_missing") and s["state"] != "gone"
                                             else ""),
             f"{s['tokens']:,}", _hbm_text(s), human_bytes(s["bytes_dram"]),
             human_bytes(s["bytes_nvme"]), _pin_text(s), _retain_text(s), _ago(s["last_use"]))
            for s in doc["sessions"]]
    print_table(f"sessions ({len(rows)} of {doc['total']})",
                ["session", "state", "tokens", "HBM", "DRAM", "NVMe", "pinned", "retained", "last use"], rows)
    notes = [(s["session_id"], s["stored_note"]) for s in doc["sessions"] if s.get("stored_note")]
    for session_id, note in notes[:5]:  # a session listed with nothing stored says why
        typer.echo(f"{session_id}: {note}")
    if len(notes) > 5:
        typer.echo(f"... and {len(notes) - 5} more with nothing stored (kvtier inspect SESSION says why)")


def _hbm_text(s: dict) -> str:
    """Its blocks in vLLM's prefix cache; ``?`` where vLLM publishes no KV cache events."""
    return "?" if s.get("bytes_hbm") is None else human_bytes(s["bytes_hbm"]) if s["bytes_hbm"] else "-"


def _pin_text(s: dict) -> str:
    """``dram``, ``nvme (29m left)`` for a timed pin, or ``-``."""
    from kvtier.units import human_duration

    if not s.get("pinned"):
        return "-"
    left = s.get("pin_left_s")
    return s["pinned"] + (f" ({human_duration(left)} left)" if left is not None else "")


def _retain_text(s: dict) -> str:
    """A live retention hint: ``4m12s left, priority 2``, or ``-``."""
    from kvtier.units import human_duration

    left = s.get("retain_left_s")
    return "-" if left is None else f"{human_duration(left)} left, priority {s.get('retain_priority')}"


def _shared_sessions(doc: dict, json_out: bool) -> None:
    if json_out:
        emit_json(doc)
        return
    rows = [(s["session_id"], s.get("box") or "-", f"{s['num_tokens']:,}", s["blocks"], s.get("pinned") or "-",
             "yes" if s.get("here") else "no", _ago(s["published"])) for s in doc["sessions"]]
    print_table(f"shared sessions in {doc['url']} ({len(rows)})",
                ["session", "box", "tokens", "blocks", "pinned", "here", "published"], rows)


@handle_errors
def inspect(session: str = typer.Argument(..., help="Session id."),
            json_out: bool = typer.Option(False, "--json", help="Print JSON."),
            socket: Optional[str] = typer.Option(None, "--socket", help=SOCKET_HELP),
            _instance: Optional[str] = INSTANCE_OPTION) -> None:
    """One session: blocks and bytes per tier, codec, tokens, last use, job in flight, and its last
    turns: what each loaded, from where, and why it recomputed the rest."""
    from kvtier.control.client import AdminClient

    doc = _client(socket).get(AdminClient.session_path(session))
    if json_out:
        emit_json(doc)
        return
    print_table(f"session {session}", ["", ""], _session_rows(doc))
    turns = doc.get("turns") or []
    if not turns:
        typer.echo("last turns: none since this server started")
        return
    from kvtier.plan.reasons import format_turn

    typer.echo("last turns (oldest first; why each recomputed what it did):")
    for turn in turns:
        typer.echo(f"  {_ago(turn['time']):>8}  {format_turn(turn)}")


def _session_rows(doc: dict) -> list[tuple]:
    rows = [("state", doc["state"]), ("tokens", f"{doc['tokens']:,}"), ("blocks", doc["blocks"]),
            ("HBM", "not known (vLLM publishes no KV cache events)" if doc.get("blocks_hbm") is None else
             f"{doc['blocks_hbm']} blocks, {human_bytes(doc['bytes_hbm'])} in vLLM's prefix cache"),
            ("DRAM", f"{doc['blocks_dram']} blocks, {human_bytes(doc['bytes_dram'])}, codec {doc['codec_dram']}"),
            ("NVMe", f"{doc['blocks_nvme']} blocks, {human_bytes(doc['bytes_nvme'])}, codec {doc['codec_nvme']}"),
            ("pinned", _pin_text(doc) if doc.get("pinned") else "no"),
            ("retained", "no" if doc.get("retain_left_s") is None
             else _retain_text(doc) + " (a request's hint: its blocks leave their tier last)"),
            ("last use", _ago(doc["last_use"])),
            ("job", doc.get("job") or "-")]
    if doc.get("stored_note"):
        rows.insert(3, ("stored", doc["stored_note"]))
    if doc.get("restore_s") is not None:
        rows.append(("next turn", f"restore {doc['restore_s'] * 1e3:.0f} ms vs recompute "
                                  f"{doc['recompute_s'] * 1e3:.0f} ms: {doc['decision']}"))
    else:
        rows.append(("next turn", "no cost model yet (the engine has not timed a prefill)"))
    return rows


@handle_errors
def jobs(job_id: Optional[int] = typer.Argument(None, help="One job."),
         json_out: bool = typer.Option(False, "--json", help="Print JSON."),
         socket: Optional[str] = typer.Option(None, "--socket", help=SOCKET_HELP),
         _instance: Optional[str] = INSTANCE_OPTION) -> None:
    """Recent jobs (pin, evict, snapshot, restore) and their state."""
    client = _client(socket)
    doc = client.get(f"/v1/jobs/{job_id}") if job_id is not None else client.get("/v1/jobs")
    if json_out:
        emit_json(doc)
        return
    rows = doc["jobs"] if job_id is None else [doc]
    print_table("jobs", ["id", "kind", "session", "state", "bytes", "seconds", "error"],
                [(j["id"], j["kind"], j["session_id"] or "-", j["state"], human_bytes(j["bytes"]),
                  f"{j['seconds']:.3f}" if j["seconds"] is not None else "-", j["error"] or "") for j in rows])


# ---- writes: each plans a job on the server, then waits for it (or prints its id) ----------------
def _write(action: str, label: str, session: str, body: dict, wait: bool, json_out: bool,
           socket: Optional[str], suffix: str = "") -> None:
    from kvtier.control.client import AdminClient

    client = _client(socket)
    job = client.post(AdminClient.session_path(session, action), body)
    _finish(client, job, wait, json_out, f"{label} {session}{suffix}")


@handle_errors
def pin(session: str = typer.Argument(..., help="Session id."),
        tier: str = typer.Option("dram", "--tier", help="dram (never demoted) or nvme (never dropped)."),
        for_: Optional[str] = typer.Option(None, "--for", help="Unpin it after this long: 90s, 30m, 2h, 1d "
                                                                "(default: until kvtier unpin)."),
        wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait for the job (default) or print its id."),
        json_out: bool = typer.Option(False, "--json", help="Print the job as JSON."),
        socket: Optional[str] = typer.Option(None, "--socket", help=SOCKET_HELP),
        _instance: Optional[str] = INSTANCE_OPTION) -> None:
    """Pin a session at a tier, until unpinned or --for a while."""
    from kvtier.units import human_duration, parse_duration

    body: dict = {"tier": tier}
    if for_ is not None:
        body["for_s"] = parse_duration(for_, "--for")
    _write("pin", "pin", session, body, wait, json_out, socket,
           suffix=f" for {human_duration(body['for_s'])}" if "for_s" in body else "")


@handle_errors
def unpin(session: str = typer.Argument(..., help="Session id."),
          json_out: bool = typer.Option(False, "--json", help="Print the job as JSON."),
          socket: Optional[str] = typer.Option(None, "--socket", help=SOCKET_HELP),
          _instance: Optional[str] = INSTANCE_OPTION) -> None:
    """Let the eviction policy move a pinned session again."""
    _write("unpin", "unpin", session, {}, True, json_out, socket)


@handle_errors
def evict(session: str = typer.Argument(..., help="Session id."),
          to: str = typer.Option(..., "--to", help="dram, nvme, or drop (forget it everywhere)."),
          yes: bool = typer.Option(False, "--yes", "-y", help="Drop without asking."),
          wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait for the job (default) or print its id."),
          json_out: bool = typer.Option(False, "--json", help="Print the job as JSON."),
          socket: Optional[str] = typer.Option(None, "--socket", help=SOCKET_HELP),
          _instance: Optional[str] = INSTANCE_OPTION) -> None:
    """Move a session's blocks down to NVMe (or back to DRAM), or drop them."""
    if to == "drop" and not yes and not typer.confirm(f"drop every stored block of session {session}?"):
        raise typer.Exit(1)
    _write("evict", f"evict to {to}", session, {"to": to}, wait, json_out, socket)


@handle_errors
def snapshot_take(session: str = typer.Argument(..., help="Session id."),
                  out: Optional[str] = typer.Option(
                      None, "--out", "-o", help="File to write (default: <snapshot dir>/<session>.kvsnap)."),
                  wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait for the job or print its id."),
                  json_out: bool = typer.Option(False, "--json", help="Print the job as JSON."),
                  socket: Optional[str] = typer.Option(None, "--socket", help=SOCKET_HELP),
                  _instance: Optional[str] = INSTANCE_OPTION) -> None:
    """kvtier snapshot SESSION [--out FILE]: write a session's KV to a portable file. With --out the
    CLI creates the file where you stand and hands it to the server, which writes only that file."""
    if not out:
        _write("snapshot", "snapshot", session, {}, wait, json_out, socket)
        return
    if not wait:
        from kvtier.errors import UsageError

        raise UsageError("--out needs --wait", hint="the CLI moves the finished file into place; drop --no-wait")
    client = _client(socket)
    label = f"snapshot {session}"
    if json_out:
        job = client.snapshot_to_file(session, out)
    else:
        from rich.console import Console

        with Console(stderr=True).status(f"{label} -> {out}…"):
            job = client.snapshot_to_file(session, out)
    _finish(client, job, False, json_out, label)


@handle_errors
def restore(file: str = typer.Argument(..., help="A .kvsnap file (opened here, handed to the server), or "
                                                 "with --shared a session id."),
            shared: bool = typer.Option(False, "--shared", help="Pull the session another box published in the "
                                                                "shared store (kvtier sessions --shared)."),
            tier: str = typer.Option("dram", "--tier", help="dram or nvme."),
            cache_salt: Optional[str] = typer.Option(
                None, "--cache-salt", help="The tenant's cache salt, when its requests carry one."),
            trust_unsigned: bool = typer.Option(
                False, "--trust-unsigned", help="Restore a file not signed by a key the server trusts "
                                                "(its keys are still recomputed from its tokens)."),
            wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait for the job (default) or print its id."),
            json_out: bool = typer.Option(False, "--json", help="Print the job as JSON."),
            socket: Optional[str] = typer.Option(None, "--socket", help=SOCKET_HELP),
            _instance: Optional[str] = INSTANCE_OPTION) -> None:
    """Bring a snapshot's session back into the tiers (its next turn loads instead of recomputing).
    The server recomputes every block key from the file's token ids: a forged file is refused."""
    from pathlib import Path

    client = _client(socket)
    body: dict = {"tier": tier}
    if cache_salt:
        body["cache_salt"] = cache_salt
    if shared:  # keys recomputed from the published token ids; values verified one by one
        job = client.post("/v1/shared/restore", {**body, "session": file})
        _finish(client, job, wait, json_out, f"restore {file} from the shared tier")
        return
    path = Path(file).expanduser()
    if trust_unsigned:
        body["trust_unsigned"] = True
    sharded = Path(f"{path}.rank1").exists()  # tensor parallel: one file per rank, read by name
    if client.url or sharded:  # no file can be handed over: the server looks in its snapshot directory
        job = client.post("/v1/restore", {**body, "path": str(path.absolute()) if sharded else path.name})
    else:
        job = client.restore_file(path, body)
    _finish(client, job, wait, json_out, f"restore {path.name}")


@handle_errors
def flush(session: Optional[str] = typer.Option(None, "--session", help="Only this session."),
          wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait for the job (default) or print its id."),
          json_out: bool = typer.Option(False, "--json", help="Print the job as JSON."),
          socket: Optional[str] = typer.Option(None, "--socket", help=SOCKET_HELP),
          _instance: Optional[str] = INSTANCE_OPTION) -> None:
    """Write every DRAM block that has no NVMe copy yet to NVMe now (they stay in DRAM too)."""
    client = _client(socket)
    job = client.post("/v1/flush", {"session": session} if session else {})
    _finish(client, job, wait, json_out, "flush" + (f" {session}" if session else ""))


def register(app: typer.Typer, snapshot_app: typer.Typer) -> None:
    """Attach the session commands to ``app`` (``snapshot SESSION`` to ``snapshot_app``, as its hidden
    ``take``), in the order ``kvtier --help`` lists them."""
    for name, command in (("status", status), ("sessions", sessions), ("inspect", inspect), ("pin", pin),
                          ("unpin", unpin), ("evict", evict)):
        app.command(name)(command)
    snapshot_app.command("take", hidden=True)(snapshot_take)
    for name, command in (("restore", restore), ("flush", flush), ("jobs", jobs)):
        app.command(name)(command)
