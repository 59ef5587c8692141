"""The admin API's operations: read views and write actions over the manager (under its lock)."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from kvtier.control.ops import API_VERSION, ApiError, resolve_snapshot_path
from kvtier.errors import NotFoundError
from kvtier.plan.index import Tier, validate_session_id
from kvtier.plan.reasons import stored_note

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.control.ops import Ops

__all__ = ["handle", "OPENAPI", "STATES"]

STATES = ("hot", "warm", "cold", "pinned", "gone")
SORT_KEYS = ("last_use", "tokens", "bytes", "session_id", "state")
_TIERS = {"dram": Tier.DRAM, "nvme": Tier.NVME}


def handle(ops: "Ops", name: str, params: dict, query: dict, body: dict, fds: list[int] | None = None) -> tuple[int,
                                                                                                                Any]:
    """``fds``: files the client handed over the Unix socket with this request (``SCM_RIGHTS``); a
    handler that keeps one sets its place in the list to -1 (the server closes the rest)."""
    session = None
    if "session" in params:
        session = validate_session_id(unquote(params["session"]))
    return _HANDLERS[name](ops, session=session, params=params, query=query, body=body, fds=fds or [])


# ---- reads -------------------------------------------------------------------------------------
MAX_WAIT_S = 300.0


def _until_clean(ops: "Ops", query: dict) -> None:
    """``?until=clean&wait_s=N``: answer once no DRAM block lacks an NVMe copy and none is still on
    its way into DRAM (a store behind the step turns dirty when it lands), or after N s: a caller
    waits on the engine's results instead of polling."""
    until = query.get("until")
    if until is None:
        return
    if until != "clean":
        raise ApiError(400, f"unknown until={until[:40]!r}", hint="the one condition is until=clean")
    try:
        wait_s = float(query.get("wait_s", "30"))
    except ValueError:
        raise ApiError(400, "wait_s must be a number of seconds", hint="for example wait_s=30") from None
    if not 0 <= wait_s <= MAX_WAIT_S:
        raise ApiError(400, f"wait_s must be between 0 and {MAX_WAIT_S:.0f}", hint="for example wait_s=30")
    views = ops.manager.views
    ops.wait_for(lambda: not any(views.dirty_stats()[k] for k in ("dirty_blocks", "storing_blocks")), wait_s)


def _status(ops: "Ops", query: dict, **_) -> tuple[int, dict]:
    _until_clean(ops, query)
    with ops.lock:
        stats = ops.manager.views.stats()
        states = ops.manager.views.session_state_counts()
        in_flight = sum(1 for r in ops.jobs.values() if r.state in ("queued", "running"))
        tiers = _tier_view(stats, ops)
        links = ops.link_bytes()
        shared = ops.shared.status() if ops.shared is not None else None
    return 200, {
        "api": API_VERSION, **ops.info, "uptime_s": time.time() - ops.started,
        "snapshot_dir": str(ops.snapshot_dir) if ops.snapshot_dir else None,
        "fingerprint": stats["fingerprint"], "tiers": tiers,
        "sessions": {state: states[state] for state in STATES}, "jobs_in_flight": in_flight,
        "dirty": stats["dirty"], "catalog": _catalog_view(ops),
        "warnings": stats["warnings"], "counters": stats["counters"], "links": links, "shared": shared,
    }


def _catalog_view(ops: "Ops") -> dict | None:
    """Called under the lock."""
    catalog = ops.manager.catalog_log.catalog
    if catalog is None:
        return None
    counters = ops.manager.telemetry.counters
    return {"path": str(catalog.path), "sessions_at_start": counters.get("catalog_sessions_at_start", 0),
            "start_ms": counters.get("catalog_start_ms", 0), "writes": counters.get("catalog_writes", 0)}


def _tier_view(stats: dict, ops: "Ops") -> dict:
    """Called under the lock."""
    return {"hbm": {**stats["hbm"], **ops.hbm()}, "dram": stats["dram"], "nvme": stats["nvme"]}


def _tiers(ops: "Ops", **_) -> tuple[int, dict]:
    with ops.lock:
        return 200, _tier_view(ops.manager.views.stats(), ops)


def _sessions(ops: "Ops", query: dict, **_) -> tuple[int, dict]:
    state = query.get("state")
    if state is not None and state not in STATES:
        raise ApiError(400, f"unknown state {state!r}", hint=f"one of: {', '.join(STATES)}")
    sort = query.get("sort", "last_use")
    if sort not in SORT_KEYS:
        raise ApiError(400, f"cannot sort by {sort!r}", hint=f"one of: {', '.join(SORT_KEYS)}")
    try:
        limit = int(query.get("limit", 10_000))
    except ValueError:
        raise ApiError(400, "limit must be an integer") from None
    if not 1 <= limit <= 100_000:
        raise ApiError(400, "limit must be between 1 and 100000")
    with ops.lock:  # ordered on columns; only the rows answered are built (100k sessions: a page stays cheap)
        rows, total = ops.manager.views.sessions_page(sort, state or None, limit)
        for row in rows:
            _decorate(ops, row)
    return 200, {"sessions": rows, "total": total}


def _session_view(ops: "Ops", session_id: str) -> dict:
    """One session, with its last turns (oldest first): what each found, loaded, and why not more
    (``kvtier.plan.reasons``). Called under the lock."""
    info = _decorate(ops, ops.manager.views.session_info(session_id))
    info["turns"] = ops.manager.turns.to_dicts(info["session_id"])
    return info


def _decorate(ops: "Ops", info: dict) -> dict:
    info["job"] = ops.busy.get(info["session_id"])
    info["stored_note"] = _stored_note(ops, info)
    info["codec_dram"], info["codec_nvme"] = ops.manager.table.warm_codec, ops.manager.table.cold_codec
    info["restore_s"] = info["recompute_s"] = info["decision"] = None
    cost = ops.cost
    if cost is not None and cost.prefill is not None and info["tokens"]:
        # the connector's own rule (decide.blocks_to_load) applied to the session as it is held now
        split = cost.split_for(0, info["blocks_dram"], info["blocks_dram"] + info["blocks_nvme"], info["tokens"])
        info["restore_s"], info["recompute_s"], info["decision"] = split.all_load_s, split.none_load_s, split.decision
    return info


def _stored_note(ops: "Ops", info: dict) -> str | None:
    """Why nothing of the session is held in DRAM or on NVMe (``reasons.stored_note``)."""
    if info["blocks_dram"] or info["blocks_nvme"]:
        return None  # the common row pays nothing more
    manager = ops.manager
    last = manager.turns.last(info["session_id"])
    session = manager.table.sessions.get(info["session_id"])
    dropped = manager.table.drops.find(session.namespace, session.keys[0]) if session is not None and session.keys \
        else None
    break_even = ops.cost.break_even_tokens(from_nvme=False) if ops.cost is not None else None
    return stored_note(info, manager.geometry.block_tokens, last is not None and last.store_skipped, break_even,
                       dropped)


def _session(ops: "Ops", session: str, **_) -> tuple[int, dict]:
    with ops.lock:
        return 200, _session_view(ops, session)


def _jobs(ops: "Ops", **_) -> tuple[int, dict]:
    with ops.lock:
        return 200, {"jobs": [r.to_dict() for r in sorted(ops.jobs.values(), key=lambda r: -r.job_id)[:200]]}


def _job(ops: "Ops", params: dict, **_) -> tuple[int, dict]:
    try:
        job_id = int(params["job"])
    except ValueError:
        raise ApiError(400, f"job id {params['job']!r} is not a number") from None
    with ops.lock:
        record = ops.jobs.get(job_id)
        if record is None:
            raise NotFoundError(f"no job {job_id}", hint="kvtier jobs lists the recent ones")
        return 200, record.to_dict()


# ---- writes ------------------------------------------------------------------------------------
def _tier(value: Any, field: str, choices: dict) -> Any:
    if value not in choices:
        raise ApiError(400, f"{field} must be one of: {', '.join(choices)}", hint=f'e.g. {{"{field}": "nvme"}}')
    return choices[value]


def _write(ops: "Ops", kind: str, session: str | None, plan, hold: int | None = None,
           detail=None) -> tuple[int, dict]:
    """Plan and submit a job; ``hold``: a handed-over file the job's worker opens, kept open until the
    job is over (closed at once when the plan fails or nothing had to move); ``detail``: called after
    the plan (under the lock), what it returns joins the job's record."""
    try:
        with ops.lock:
            if session is not None:
                ops.manager.table.session(session)  # 404 before 409
                ops._check_free(session)
            record = ops._submit(kind, session, plan())
            if detail is not None:
                record.detail.update(detail())
            if hold is not None and record.state == "queued":
                ops.held_fds[record.job_id], hold = hold, None
    finally:
        if hold is not None:
            os.close(hold)
    ops.manager.catalog_log.sync_catalog(ops.lock)  # a pin (or a drop) is in the session catalog before the answer
    if record.state == "queued":
        ops.wake()
    return 202, record.to_dict()


MAX_PIN_S = 366 * 86400.0


def _pin_seconds(value: Any) -> float | None:
    """``for_s`` of a pin: more than 0 seconds, at most a year (absent: pinned until unpinned)."""
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= MAX_PIN_S:
        raise ApiError(400, f"for_s must be a number of seconds from 0 to {MAX_PIN_S:.0f}, not {value!r:.40}",
                       hint='e.g. {"tier": "dram", "for_s": 1800}; leave it out to pin until unpinned')
    return float(value)


def _pin(ops: "Ops", session: str, body: dict, **_) -> tuple[int, dict]:
    tier = _tier(body.get("tier", "dram"), "tier", _TIERS)
    for_s = _pin_seconds(body.get("for_s"))
    return _write(ops, "pin", session, lambda: ops.manager.planner.pin(session, tier, for_s),
                  detail=lambda: {"pin_expires_at": ops.manager.table.session(session).pin_expires})


def _unpin(ops: "Ops", session: str, **_) -> tuple[int, dict]:
    return _write(ops, "unpin", session, lambda: ops.manager.planner.unpin(session))


def _evict(ops: "Ops", session: str, body: dict, **_) -> tuple[int, dict]:
    to = _tier(body.get("to"), "to", {"dram": Tier.DRAM, "nvme": Tier.NVME, "drop": None})
    if to == Tier.DRAM:  # kvtier writes through: a session's blocks are in DRAM unless demoted
        return _write(ops, "evict", session, lambda: ops.manager.planner.promote(session))
    return _write(ops, "evict", session, lambda: ops.manager.planner.evict(session, to))


def _handed(body: dict, fds: list[int], writable: bool) -> int | None:
    """The file the client handed over (``{"fd": 0}``), checked: a regular file, open for writing
    when it is to be written. None when the body names no handed-over file."""
    import fcntl
    import stat

    if "fd" not in body:
        return None
    index = body["fd"]
    if "path" in body:
        raise ApiError(400, "give a path or a handed-over file, not both")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(fds) or fds[index] < 0:
        raise ApiError(400, "no file was handed over with this request",
                       hint="the CLI hands the file it opened over the Unix socket (SCM_RIGHTS)")
    fd = fds[index]
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise ApiError(400, "the file handed over is not a regular file")
    mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    if writable and mode == os.O_RDONLY:
        raise ApiError(400, "the file handed over is not open for writing")
    return fd


def _adopt(fds: list[int], fd: int) -> str:
    """Take a handed-over file from the request (``_write`` keeps it open for the job) and return the
    path the worker opens it by."""
    fds[fds.index(fd)] = -1
    return f"/proc/{os.getpid()}/fd/{fd}"


def _snapshot(ops: "Ops", session: str, body: dict, fds: list[int], **_) -> tuple[int, dict]:
    handed = _handed(body, fds, writable=True)
    if handed is not None:
        if ops.manager.fingerprint.shards > 1:
            raise ApiError(400, "a tensor-parallel snapshot is one file per rank: it cannot be written to a "
                                "handed-over file", hint="snapshot into the server's snapshot directory (no --out)")
        path = _adopt(fds, handed)
        return _write(ops, "snapshot", session,
                      lambda: ops.manager.planner.prepare_snapshot(session, path, in_place=True), hold=handed)
    path = resolve_snapshot_path(ops, body.get("path"), session)
    from kvtier.persist.snapshot import overwrite_refusal

    refusal = overwrite_refusal(path)
    if refusal:
        raise ApiError(400, refusal, hint="kvtier only overwrites its own snapshot files; choose another path")
    if not path.parent.is_dir():
        if os.path.realpath(path.parent) == os.path.realpath(ops.snapshot_dir):
            path.parent.mkdir(parents=True, exist_ok=True)
        else:
            raise ApiError(400, f"directory {path.parent} does not exist", hint="create it first")
    return _write(ops, "snapshot", session, lambda: ops.manager.planner.prepare_snapshot(session, str(path)))


def _cache_salt(body: dict) -> str | None:
    """The tenant's cache salt a restore names (a snapshot's or a shared session's), checked."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 1024):
        raise ApiError(400, "cache_salt must be a non-empty string", hint="the salt the tenant's requests carry")
    return salt


def _restore(ops: "Ops", body: dict, fds: list[int], **_) -> tuple[int, dict]:
    handed = _handed(body, fds, writable=False)
    if handed is not None and ops.manager.fingerprint.shards > 1:
        raise ApiError(400, "a tensor-parallel snapshot is one file per rank: hand-over restores one file only",
                       hint="copy the files into the server's snapshot directory and restore by name")
    if handed is None and "path" not in body:
        raise ApiError(400, "restore needs a snapshot path", hint='{"path": "/data/snapshots/agent.kvsnap"}')
    tier = _tier(body.get("tier", "dram"), "tier", _TIERS)
    salt = _cache_salt(body)
    trust_unsigned = body.get("trust_unsigned", False)
    if not isinstance(trust_unsigned, bool):
        raise ApiError(400, "trust_unsigned must be true or false")
    path = Path(_adopt(fds, handed)) if handed is not None else resolve_snapshot_path(ops, body["path"], "restore")
    try:
        return _restore_file(ops, path, tier, salt, trust_unsigned, handed)
    except BaseException:
        if handed is not None and handed not in ops.held_fds.values():
            os.close(handed)
        raise


def _restore_file(ops: "Ops", path: Path, tier, salt, trust_unsigned: bool, handed: int | None) -> tuple[int, dict]:
    from kvtier.persist.snapshot import open_snapshot
    from kvtier.persist.trust import keys_file, load_keys

    # validates the whole header (SnapshotError -> 400 with a hint), no longer than a session here can
    # need, and its signature: only snapshots signed by a trusted key restore unless the operator says so
    info = open_snapshot(path, ops.manager.planner.max_snapshot_header(), trusted_keys=load_keys())
    if not info.signed and not trust_unsigned:
        with ops.lock:
            ops.manager.telemetry.count("restores_refused_unsigned")
        raise ApiError(400, f"snapshot {path} is not signed by a key this server trusts",
                       hint=f"snapshots of other boxes: add their key to {keys_file()}; or, if you trust this "
                            "file, restore it with --trust-unsigned")
    with ops.lock:
        ops._check_free(info.session_id)
        # keys recomputed from the file's token ids, the namespace this engine's own: nothing the
        # file says decides where its KV goes (refused files take no slot, row or NVMe byte)
        record = ops._submit("restore", info.session_id,
                             ops.manager.planner.prepare_restore(info, tier, salt, require_signed=not trust_unsigned))
        if handed is not None and record.state == "queued":  # the worker reads it: open until the job ends
            ops.held_fds[record.job_id], handed = handed, None
    if handed is not None:
        os.close(handed)
    ops.manager.catalog_log.sync_catalog(ops.lock)
    if record.state == "queued":
        ops.wake()
    return 202, record.to_dict()


def _flush(ops: "Ops", body: dict, **_) -> tuple[int, dict]:
    session = body.get("session")
    if session is not None:
        session = validate_session_id(session)
    return _write(ops, "flush", session, lambda: ops.manager.pressure.flush(session))


def _costmodel(ops: "Ops", **_) -> tuple[int, dict]:
    with ops.lock:
        if ops.cost is None:
            return 200, {"available": False}
        return 200, {"available": True, **ops.cost.report()}


def _need_shared(ops: "Ops"):
    if ops.shared is None:
        raise ApiError(400, "this server has no shared tier", hint="start it with kvtier serve --shared redis://HOST:PORT")
    return ops.shared


def _shared(ops: "Ops", **_) -> tuple[int, dict]:
    with ops.lock:
        return 200, {"configured": ops.shared is not None, **(ops.shared.status() if ops.shared is not None else {})}


def _shared_sessions(ops: "Ops", query: dict, **_) -> tuple[int, dict]:
    """What the boxes sharing the store published for this model (one round trip; no lock held)."""
    from kvtier.tiers.shared.store import SharedUnavailable

    shared = _need_shared(ops)
    try:
        limit = int(query.get("limit", 1000))
    except ValueError:
        raise ApiError(400, "limit must be a whole number", hint="e.g. ?limit=100") from None
    try:
        entries = shared.store.sessions.list_sessions(ops.manager.fingerprint.digest, max(1, min(limit, 100_000)))
    except SharedUnavailable as exc:
        raise ApiError(503, str(exc), hint="the shared store is down or refusing us; kvtier status says why") from None
    with ops.lock:
        local = ops.manager.table.sessions
        for entry in entries:
            entry["here"] = entry["session_id"] in local
    return 200, {"url": shared.store.client.url, "sessions": entries}


def _shared_restore(ops: "Ops", body: dict, **_) -> tuple[int, dict]:
    """Pull a session another box published: its keys recomputed from its token ids, the blocks the
    store still holds fetched into DRAM (or NVMe) -- a FETCH job, verified value by value."""
    from kvtier.errors import NotFoundError
    from kvtier.tiers.shared.store import SharedUnavailable

    shared = _need_shared(ops)
    session = validate_session_id(body.get("session") or "")
    tier = _tier(body.get("tier", "dram"), "tier", _TIERS)
    salt = _cache_salt(body)
    manager = ops.manager
    try:
        entry = shared.store.sessions.session_entry(manager.fingerprint.digest, session)
        if entry is None:
            raise NotFoundError(f"no session {session!r} in the shared store {shared.store.client.url}",
                                hint="`kvtier sessions --shared` lists what the boxes published (entries expire)")
        namespace, keys = manager.planner.shared_entry_keys(entry, salt)
        sizes = shared.store.blocks.lengths(namespace, keys, manager.fingerprint.shards)
    except SharedUnavailable as exc:
        raise ApiError(503, str(exc), hint="the shared store is down or refusing us; kvtier status says why") from None
    found = shared.store.blocks.stored_prefix(sizes)
    with ops.lock:
        ops._check_free(session)
        planner = manager.planner
        planner.record_session(session, namespace, keys, int(entry.get("num_tokens") or 0),
                               token_ids=entry["token_ids"])
        record = ops._submit("fetch", session, planner.prepare_fetch(namespace, keys[:found], sizes[:found], tier,
                                                                     session_id=session))
        record.detail.update({"blocks_published": len(keys), "blocks_in_store": found, "box": entry.get("box")})
    ops.manager.catalog_log.sync_catalog(ops.lock)
    if record.state == "queued":
        ops.wake()
    return 202, record.to_dict()


def _openapi(ops: "Ops", **_) -> tuple[int, dict]:
    return 200, OPENAPI


_HANDLERS = {"status": _status, "tiers": _tiers, "sessions": _sessions, "session": _session, "jobs": _jobs,
             "job": _job, "pin": _pin, "unpin": _unpin, "evict": _evict, "snapshot": _snapshot,
             "restore": _restore, "flush": _flush, "openapi": _openapi,
             "costmodel": _costmodel, "shared": _shared, "shared_sessions": _shared_sessions,
             "shared_restore": _shared_restore}


def _op(summary: str, body: dict | None = None, params: tuple = ()) -> dict:
    op: dict = {"summary": summary, "responses": {"200": {"description": "ok"}, "202": {"description": "job"},
                                                    "400": {"description": "bad request"},
                                                    "404": {"description": "not found"},
                                                    "409": {"description": "session busy"}}}
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params]
    if body is not None:
        op["requestBody"] = {"content": {"application/json": {"schema": {
            "type": "object", "additionalProperties": False, "properties": body}}}}
    return op


_TIER_ENUM = {"type": "string", "enum": ["dram", "nvme"]}
OPENAPI = {
    "openapi": "3.0.3",
    "info": {"title": "kvtier admin API", "version": API_VERSION},
    "paths": {
        "/v1/status": {"get": _op("Model, tiers, sessions by state, jobs, warnings (query: until=clean "
                                  "and wait_s: answer once every DRAM block has an NVMe copy)")},
        "/v1/tiers": {"get": _op("Per tier: bytes, capacity, blocks, codec, tokens per GiB")},
        "/v1/sessions": {"get": _op("Sessions (query: state, sort, limit)")},
        "/v1/sessions/{session}": {"get": _op("One session, with its last turns and why each recomputed",
                                              params=("session",))},
        "/v1/jobs": {"get": _op("Recent jobs")},
        "/v1/jobs/{job}": {"get": _op("One job", params=("job",))},
        "/v1/sessions/{session}/pin": {"post": _op("Pin at a tier, until unpinned or for for_s seconds", {
            "tier": _TIER_ENUM, "for_s": {"type": "number", "exclusiveMinimum": 0}}, ("session",))},
        "/v1/sessions/{session}/unpin": {"post": _op("Unpin", {}, ("session",))},
        "/v1/sessions/{session}/evict": {"post": _op("Evict to a tier or drop", {
            "to": {"type": "string", "enum": ["dram", "nvme", "drop"]}}, ("session",))},
        "/v1/sessions/{session}/snapshot": {"post": _op("Snapshot to a file", {"path": {"type": "string"}},
                                                         ("session",))},
        "/v1/restore": {"post": _op("Restore a snapshot file (keys recomputed from its token ids)",
                                    {"path": {"type": "string"}, "tier": _TIER_ENUM,
                                     "cache_salt": {"type": "string"}, "trust_unsigned": {"type": "boolean"}})},
        "/v1/flush": {"post": _op("Copy DRAM-only blocks (all, or one session's) to NVMe now",
                                  {"session": {"type": "string"}})},
        "/v1/costmodel": {"get": _op("Measured link rates, the fitted prefill model, break-even lengths")},
        "/v1/shared": {"get": _op("The shared tier: store, state, link, bytes, hits")},
        "/v1/shared/sessions": {"get": _op("Sessions the boxes sharing the store published (query: limit)")},
        "/v1/shared/restore": {"post": _op("Fetch a published session's blocks into this box", {
            "session": {"type": "string"}, "tier": _TIER_ENUM, "cache_salt": {"type": "string"}})},
        "/metrics": {"get": _op("Prometheus metrics")},
    },
}
