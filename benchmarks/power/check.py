"""Each crash state replayed onto a fresh directory, started, and checked against what kvtier had
acknowledged before the power cut.

Checked in every state:
* start-up (segments, journal, catalog) does not raise;
* every block acknowledged as durable (and not dropped since) is served with its exact bytes;
* no block is ever served with wrong bytes (every block the tier lists is read and compared; a
  read that fails is a detected loss, not a wrong load);
* the catalog lists only sessions whose keys are the chain of their own tokens, and a prefix of
  what was stored for them (a wrong entry would make a snapshot or a load of other tokens' KV);
  their blocks are there or the session shows fewer stored blocks (the index is the truth);
* an acknowledged snapshot is there, verifies and restores bit for bit; any snapshot file
  visible verifies or is refused (never restored wrong);
* after start-up's cleaning (and a compaction where holes cannot be punched) the tier's files take
  no more room on disk than its budget.

A loss of something acknowledged only as ``stored`` (in DRAM, not yet written behind) is a loss in
the write-behind window; one of a session committed to the catalog in the last commits is in
SQLite's window if it ran with ``synchronous=NORMAL`` (kvtier runs it with ``FULL``: no window).
Both are counted apart from the acknowledged losses.
"""
from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.power.trace import Op

__all__ = ["Acked", "acked_before", "check_store", "check_engine"]


@dataclass
class Acked:
    blocks: set = field(default_factory=set)  # (namespace, key) acknowledged durable on NVMe
    stored: set = field(default_factory=set)  # keys the engine accepted (DRAM): write-behind's window
    snapshots: set = field(default_factory=set)
    sessions: dict = field(default_factory=dict)  # session id -> its keys when last committed


def in_flight_sessions(later: list[Op]) -> dict[str, bytes]:
    """The sessions the commit in flight at the cut was writing (its puts, acknowledged just after):
    with its log frames all written, a power cut may keep it."""
    for op in later:
        if op.kind == "ack" and op.what == "sessions" and any(change == "put" for change, _s, _k in op.items):
            return {sid: keys for change, sid, keys in op.items if change == "put"}
    return {}


def acked_before(ops: list[Op]) -> Acked:
    acked = Acked()
    for op in ops:
        if op.kind != "ack":
            continue
        if op.what == "blocks":
            acked.blocks.update(op.items)
        elif op.what == "blocks_dropping":  # asked to drop: no longer owed, whether or not the cut kept it
            acked.blocks.difference_update(op.items)
        elif op.what == "wiped":  # the operator removed it all: nothing before it is owed
            acked = Acked()
        elif op.what == "stored":
            acked.stored.update(op.items)
        elif op.what == "snapshot":
            acked.snapshots.update(str(p) for p in op.items)
        elif op.what == "sessions":  # drops marked when asked for, puts once committed
            for change, sid, keys in op.items:
                if change == "put":
                    acked.sessions[sid] = keys
                else:
                    acked.sessions.pop(sid, None)
    return acked


def _failure(out: Counter, causes: list, label: str, exc: BaseException) -> None:
    out["start_crashes"] += 1
    where = traceback.extract_tb(exc.__traceback__)[-1]
    causes.append(f"{label}: {type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})")


def check_store(directory: Path, acked: Acked, capacity: int, label: str, causes: list) -> Counter:
    """A store workload's state in ``directory``: start, read everything, compare."""
    from benchmarks.power.workloads import FINGERPRINT, payload
    from kvtier.errors import KvtierError
    from kvtier.tiers.nvme.store import NvmeStore

    out: Counter = Counter(states=1)
    try:
        store = NvmeStore(directory / "nvme", capacity, io_threads=1, direct="off")
    except Exception as exc:  # noqa: BLE001 - a start-up crash is what is counted
        _failure(out, causes, label, exc)
        return out
    try:
        listed = {(r.namespace, r.key): r.nbytes for r in store.scan()}
        for name in sorted(set(listed) | acked.blocks):
            nbytes = listed.get(name)
            good = False
            if nbytes is not None:
                buffer = bytearray(nbytes)
                try:
                    got, _codec = store.read_into(name[0], name[1], buffer, FINGERPRINT)
                    good = bytes(buffer[:got]) == payload(name[1], nbytes)
                    out["wrong_bytes"] += not good
                    if not good:
                        causes.append(f"{label}: block {name[1].hex()[:12]} read back with wrong bytes")
                except KvtierError:
                    out["detected_bad_records"] += 1
                out["blocks_read"] += 1
            if name in acked.blocks and not good:
                out["acked_lost"] += 1
                causes.append(f"{label}: acknowledged block {name[1].hex()[:12]} lost")
        out["acked_checked"] += len(acked.blocks)
        _check_room(store, capacity, out, causes, label)
    finally:
        store.close()
    return out


def _check_room(store, capacity: int, out: Counter, causes: list, label: str) -> None:
    if not store.can_punch:
        store.compact(max_bytes=capacity, sparse=1.0)
    if store.disk_bytes() > capacity:
        out["over_budget"] += 1
        causes.append(f"{label}: the tier's files take {store.disk_bytes()} bytes, budget {capacity}")


def check_engine(directory: Path, acked: Acked, tokens: dict, dram_blocks: int, nvme_blocks: int, label: str,
                 causes: list, in_flight: dict[str, bytes] | None = None) -> Counter:
    """An engine workload's state: restart the engine, load every visible block, check the catalog
    and the snapshots."""
    from benchmarks.faults.world import World

    out: Counter = Counter(states=1)
    try:
        world = World(directory, dram_blocks=dram_blocks, nvme_blocks=nvme_blocks)
    except Exception as exc:  # noqa: BLE001 - a start-up crash is what is counted
        _failure(out, causes, label, exc)
        return out
    try:
        visible = world.visible_nvme_keys()
        wrong, unreadable = _load_all(world, sorted(visible))
        out["blocks_read"] += len(visible)
        out["wrong_bytes"] += len(wrong)
        causes += [f"{label}: block {k.hex()[:12]} loaded with wrong bytes" for k in wrong]
        durable = {key for _ns, key in acked.blocks}
        lost = (durable - visible) | (durable & unreadable)
        out["acked_lost"] += len(lost)
        causes += [f"{label}: acknowledged block {k.hex()[:12]} lost" for k in sorted(lost)]
        out["acked_checked"] += len(durable)
        out["window_losses"] += len((acked.stored - durable) - visible)
        _check_catalog(world, acked, tokens, out, causes, label, in_flight or {})
        _check_snapshots(world, acked, out, causes, label)
        _check_room(world.engine.nvme, nvme_blocks * _record_bytes(world), out, causes, label)
    finally:
        world.close()
    return out


def _record_bytes(world) -> int:
    from kvtier.tiers.records import file_bytes_for

    return file_bytes_for(world.geometry.block_bytes)


def _load_all(world, keys: list[bytes]) -> tuple[list[bytes], set[bytes]]:
    """Every key loaded through the engine's load path into scrubbed HBM blocks: (wrong, unreadable)."""
    from benchmarks.faults.world import HBM_BLOCKS

    manager, wrong, unreadable = world.engine.manager, [], set()
    for start in range(0, len(keys), HBM_BLOCKS):
        batch = keys[start : start + HBM_BLOCKS]
        device = list(range(len(batch)))
        world.scrub(device)
        rows = [manager.table.index.row_of(world.ns, k) for k in batch]
        result = world.engine.execute(manager.prepare_load(rows, device))
        failed = set(result.failed or ()) if result is not None and (result.ok or result.failed) \
            else set(range(len(batch)))
        unreadable |= {batch[i] for i in failed}
        good = [i for i in range(len(batch)) if i not in failed]
        wrong += world.wrong([batch[i] for i in good], [device[i] for i in good])
    return wrong, unreadable


def _check_catalog(world, acked: Acked, tokens: dict, out: Counter, causes: list, label: str,
                   in_flight: dict[str, bytes]) -> None:
    from benchmarks.faults.world import SHAPE
    from kvtier.persist.catalog import decode_tokens
    from kvtier.plan.index import chain_block_hashes

    catalog = world.engine.catalog
    sessions = world.engine.manager.table.sessions
    for sid, session in sessions.items():
        keys = list(session.keys)
        data = catalog.token_ids(sid)
        ids = [int(t) for t in decode_tokens(data)] if data else []
        truth = tokens.get(sid)
        chained = chain_block_hashes(ids, SHAPE[3])[: len(keys)]
        right = truth is not None and ids == truth[: len(ids)] and keys == chained
        committed = {acked.sessions.get(sid), in_flight.get(sid)} - {None}
        out["catalog_versions_checked"] += bool(committed)
        if right and committed and b"".join(keys) not in committed:  # an older version came back
            right = False
        if not right:
            out["catalog_wrong"] += 1
            causes.append(f"{label}: catalog entry {sid} does not match what was stored for it")
        out["catalog_sessions"] += 1
    from kvtier.persist.catalog import SYNCHRONOUS

    missing = [sid for sid in acked.sessions if sid not in sessions]
    if SYNCHRONOUS == "FULL":  # a returned commit is durable: a missing session is a loss
        out["acked_lost"] += len(missing)
        causes += [f"{label}: committed session {sid} missing from the catalog" for sid in missing]
    else:  # the last commits since a checkpoint: synchronous=NORMAL's window
        out["catalog_window_losses"] += len(missing)
    out["catalog_partial"] += sum(1 for s in sessions.values() if not s.keys or
                                  any(k not in world.visible_nvme_keys() for k in s.keys))


def _check_snapshots(world, acked: Acked, out: Counter, causes: list, label: str) -> None:
    from kvtier.persist.snapshot import open_snapshot, verify_snapshot

    owed = {Path(p).name for p in acked.snapshots}  # recorded under another root: by name
    present = {p.name: p for p in world.snapshots.glob("*.kvsnap")}
    for name in sorted(owed - present.keys()):
        out["acked_lost"] += 1
        causes.append(f"{label}: acknowledged snapshot {name} lost")
    for name, path in sorted(present.items()):
        try:
            info = verify_snapshot(open_snapshot(path), world.fingerprint)
        except Exception:  # noqa: BLE001 - refused: never restored
            out["snapshots_refused"] += 1
            if name in owed:
                out["acked_lost"] += 1
                causes.append(f"{label}: acknowledged snapshot {name} does not verify")
            continue
        keys = [b.key for b in info.blocks]
        wrong = _wrong_in_file(world, info, keys)  # the file itself, block by block
        world.engine.restore(path)
        loaded, wrong_loaded = world.load_and_check(keys)  # and through a restore and a load
        out["snapshots_checked"] += 1
        out["wrong_bytes"] += len(wrong) + len(wrong_loaded)
        if wrong or wrong_loaded:
            causes.append(f"{label}: snapshot {name} holds or restored {len(wrong) + len(wrong_loaded)} wrong blocks")
        if loaded < len(keys) and name in owed:
            out["acked_lost"] += 1
            causes.append(f"{label}: acknowledged snapshot {name} restored {loaded} of {len(keys)} blocks")


def _wrong_in_file(world, info, keys: list[bytes]) -> list[bytes]:
    import torch

    from benchmarks.faults.world import reference_block
    from kvtier.persist.snapshot.read import read_blocks

    wrong = []
    for index, payload in read_blocks(info, world.fingerprint):
        if bytes(payload) != reference_block(keys[index], world.geometry).view(torch.int16).numpy().tobytes():
            wrong.append(keys[index])
    return wrong
