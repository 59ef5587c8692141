"""Hostile input: crafted snapshots, forged ones (poisoning), and paths a client names (part of
``python -m benchmarks faults``)."""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Callable

from benchmarks.faults.world import (
    SHAPE,
    World,
    _fingerprint,
    _tokens,
    reference_block,
)


# ---- hostile input -------------------------------------------------------------------------------------------
def _crafted_snapshots(directory: Path, fingerprint, other_fingerprint) -> list[tuple[str, Path]]:
    """Snapshot files with valid checksums and hostile contents."""
    import xxhash

    from kvtier.persist.snapshot import _PREAMBLE, FORMAT_VERSION, MAGIC, PREAMBLE_BYTES, write_snapshot
    from kvtier.tiers.dram import PAGE, round_up

    base = directory / "base.kvsnap"
    payloads = [bytes([i]) * 3000 for i in range(3)]
    keys = [bytes([i]) * 32 for i in range(3)]
    write_snapshot(base, fingerprint, "victim", bytes(16), "none", 48, keys, payloads, token_ids=list(range(48)))
    raw = base.read_bytes()
    _m, _v, _f, header_len, _x, payload_offset, file_len = _PREAMBLE.unpack_from(raw)
    header = json.loads(raw[PREAMBLE_BYTES : PREAMBLE_BYTES + header_len])
    cases: list[tuple[str, Path]] = []

    def craft(name: str, doc: dict, tail: bytes | None = None, file_len_override: int | None = None,
              header_len_override: int | None = None) -> None:
        text = json.dumps(doc).encode()
        hlen = len(text)
        offset = round_up(PREAMBLE_BYTES + hlen)
        body = raw[payload_offset:] if tail is None else tail
        total = offset + len(body) if file_len_override is None else file_len_override
        pre = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, header_len_override or hlen, xxhash.xxh3_64_intdigest(text),
                             offset, total)
        data = pre.ljust(PREAMBLE_BYTES, b"\0") + text
        data = data.ljust(offset, b"\0") + body
        path = directory / f"{name}.kvsnap"
        path.write_bytes(data)
        cases.append((name, path))

    def blocks(**change) -> dict:
        doc = json.loads(json.dumps(header))
        for i, block in enumerate(doc["blocks"]):
            block.update({k: v[i] if isinstance(v, list) else v for k, v in change.items()})
        return doc

    craft("offset_past_end", blocks(offset=[payload_offset, payload_offset + PAGE, 1 << 62]))
    craft("offset_negative", blocks(offset=[-PAGE, payload_offset, payload_offset + PAGE]))
    craft("nbytes_overflow", blocks(nbytes=[2**64 - 1, 3000, 3000]))
    craft("nbytes_huge", blocks(nbytes=[1 << 40, 3000, 3000]))
    craft("overlapping_blocks", blocks(offset=[payload_offset] * 3))
    craft("unaligned_offset", blocks(offset=[payload_offset + 1, payload_offset + PAGE, payload_offset + 2 * PAGE]))
    many = json.loads(json.dumps(header))
    many["blocks"] = many["blocks"] * 4000
    craft("block_count_lies", many)
    tokens = json.loads(json.dumps(header))
    tokens["num_tokens"] = 2**70
    craft("num_tokens_overflow", tokens)
    keyed = blocks(key=["zz", "00", "11"])
    craft("key_not_hex", keyed)
    other = json.loads(json.dumps(header))
    other["fingerprint"] = other_fingerprint.to_dict()
    craft("other_model", other)
    forged = json.loads(json.dumps(header))
    forged["fingerprint"]["model_id"] = "someone-else"  # digest kept: must not be trusted alone
    craft("fingerprint_forged", forged)
    craft("file_len_lies", header, file_len_override=file_len * 1000)
    craft("header_len_lies", header, header_len_override=1 << 40)
    session = json.loads(json.dumps(header))
    session["session_id"] = "../../etc/passwd"
    craft("session_id_traversal", session)
    return cases


def run_hostile(examples: int = 600, directory: Path | None = None, progress: Callable[[str], None] = print) -> dict:
    """Hostile input at every door: the admin API, snapshot files, session ids, other models' blocks."""
    from benchmarks.admin import run_fuzz
    from kvtier.errors import KvtierError
    from kvtier.persist.snapshot import open_snapshot
    from kvtier.plan.index import Tier, chain_block_hashes, namespace_of, validate_session_id

    out = {"hostile_inputs": 0, "hostile_crashes": 0, "hostile_accepted": 0, "served_across_models": 0,
           "served_across_tenants": 0}
    cases: dict[str, str] = {}
    fuzz = run_fuzz(examples, progress)
    out["hostile_inputs"] += fuzz["fuzz_requests"]
    out["hostile_crashes"] += fuzz["fuzz_crashes"]
    out["hostile_accepted"] += fuzz["fuzz_accepted_invalid"]
    with tempfile.TemporaryDirectory(prefix="kvtier-faults-hostile-", dir=directory) as tmp:
        root = Path(tmp)
        world = World(root / "a")
        try:
            crafted = root / "crafted"
            crafted.mkdir()
            for name, path in _crafted_snapshots(crafted, world.fingerprint, _fingerprint("another-model")):
                out["hostile_inputs"] += 1
                try:
                    world.engine.restore(path)
                    cases[name] = "ACCEPTED"
                    out["hostile_accepted"] += 1
                except KvtierError as exc:
                    cases[name] = str(exc).split("\n")[0][:120]
                except Exception as exc:  # noqa: BLE001 - anything but a clear kvtier error is a crash
                    cases[name] = f"CRASH {type(exc).__name__}: {exc}"
                    out["hostile_crashes"] += 1
            for odd in ("", "..", "../x", "a/b", "a\0b", "x" * 1000, "ünï\u202e", "-rf", "a b", "\n"):
                out["hostile_inputs"] += 1
                try:
                    validate_session_id(odd)
                    out["hostile_accepted"] += 1
                    cases[f"session_id {odd!r}"] = "ACCEPTED"
                except KvtierError:
                    pass
                except Exception:  # noqa: BLE001
                    out["hostile_crashes"] += 1
            # blocks written under another model, and under another tenant's cache salt
            keys = chain_block_hashes(_tokens(77, 4), SHAPE[3])
            world.put(keys, range(4))
            world.engine.store("tenant-a", world.ns, keys, [0, 1, 2, 3])
            world.engine.evict("tenant-a", Tier.NVME)
            salted = namespace_of(world.fingerprint.digest, "tenant-b-salt")
            out["hostile_inputs"] += 1
            out["served_across_tenants"] += world.engine.load(salted, keys, [8, 9, 10, 11])
            world.close()
            other_root = root / "b"
            shutil.copytree(root / "a", other_root)
            other = World(other_root, name="another-model")  # the same files, another model's engine
            out["hostile_inputs"] += 1
            other_ns = namespace_of(other.fingerprint.digest)
            out["served_across_models"] += other.engine.load(other_ns, keys, [0, 1, 2, 3])
            out["served_across_models"] += other.engine.load(world.ns, keys, [0, 1, 2, 3])  # even asked by name
            other.close()
            world = World(root / "a")
            info = None
            with contextlib.suppress(KvtierError):
                info = open_snapshot(crafted / "session_id_traversal.kvsnap")
            if info is not None and "/" in info.session_id:
                cases["session_id_traversal"] += " (opened; its id is refused on restore)"
        finally:
            world.close()
    out["hostile_crashes"] += out["served_across_models"] + out["served_across_tenants"]
    out["_cases"] = cases
    return out


# ---- snapshot poisoning (issue 19) ---------------------------------------------------------------------
_PRE = struct.Struct("<8sHHQQQQ")


def _forge(data: bytes, rng, kind: str, other_payload: bytes, other_keys: list[bytes]) -> bytes:
    """A forged copy of the genuine snapshot ``data``: header fields or payloads changed the way the
    format allows, every checksum recomputed (only the signature cannot be, without the key)."""
    import xxhash

    from kvtier.persist.snapshot import PREAMBLE_BYTES
    from kvtier.plan.index import chain_block_hashes, namespace_of

    magic, version, flags, header_len, _sum, payload_offset, file_len = _PRE.unpack_from(data)
    doc = json.loads(data[PREAMBLE_BYTES:PREAMBLE_BYTES + header_len])
    body = bytearray(data[payload_offset:file_len])
    blocks, bt = doc["blocks"], SHAPE[3]
    j = rng.randrange(len(blocks))
    if kind == "payload":  # the victim's tokens and keys, someone else's KV
        start = blocks[j]["offset"] - payload_offset
        body[start:start + blocks[j]["nbytes"]] = other_payload[:blocks[j]["nbytes"]]
        blocks[j]["xxh3"] = xxhash.xxh3_64_intdigest(bytes(body[start:start + blocks[j]["nbytes"]]))
    elif kind == "key":
        blocks[j]["key"] = (other_keys[j] if rng.random() < 0.5 else rng.randbytes(32)).hex()
    elif kind == "token_ids":
        tokens = doc["token_ids"]
        tokens[rng.randrange(len(tokens))] = rng.randrange(50_000)
        if rng.random() < 0.5:  # consistent: the keys recomputed for the forged tokens (the hash is public)
            for block, key in zip(blocks, chain_block_hashes(tokens, bt)):
                block["key"] = key.hex()
    elif kind == "namespace":
        doc["namespace"] = (rng.randbytes(16) if rng.random() < 0.5 else
                            namespace_of(bytes.fromhex(doc["fingerprint"]["digest"]), "another-tenant")).hex()
    elif kind == "fingerprint":
        field = rng.choice(["model_id", "weights", "num_layers", "block_tokens", "dtype"])
        if field in ("model_id", "weights"):
            doc["fingerprint"][field] = f"forged-{rng.randrange(1000)}"
        else:
            geometry = doc["fingerprint"]["geometry"]
            geometry[field] = "float32" if field == "dtype" else geometry[field] + 1
    elif kind == "scheme":  # claims another hash so its keys are not compared, and moves them
        doc.setdefault("meta", {})["key_scheme"] = "vllm:xxhash:forged"
        blocks[j]["key"] = other_keys[j].hex()
    elif kind == "session":
        doc["session_id"] = rng.choice(["../../etc/passwd", "a/b", "", "x" * 300, "agent\n"])
    else:  # "tamper": nothing that matters changed, but the signed bytes did
        doc["created"] = rng.random() * 1e9
    text = json.dumps(doc).encode()
    if len(text) > header_len:
        text = json.dumps(doc, separators=(",", ":")).encode()
    header = text.ljust(header_len, b" ")[:header_len]
    pre = _PRE.pack(magic, version, flags, header_len, xxhash.xxh3_64_intdigest(header), payload_offset,
                    file_len).ljust(PREAMBLE_BYTES, b"\0")  # and no signature: the forger has no key
    return pre + header + data[PREAMBLE_BYTES + header_len:payload_offset] + bytes(body)


POISON_KINDS = ("payload", "key", "token_ids", "namespace", "fingerprint", "scheme", "session", "tamper")


def run_poisoning(attempts: int = 240, refused_restores: int = 1000, seed: int = 0, directory: Path | None = None,
                  progress: Callable[[str], None] = print) -> dict:
    """Forged snapshots (valid checksums) restored through a real admin server: none may be accepted,
    none may make a later load of the victim's prefix return other KV, and refusing them 1,000 times
    must leak no DRAM slot, index row, NVMe byte or session."""
    import torch

    from kvtier.control.client import AdminClient
    from kvtier.control.local import LocalAdmin
    from kvtier.errors import KvtierError
    from kvtier.plan.index import chain_block_hashes

    rng = random.Random(seed)
    out = {"poisoning_attempts": 0, "accepted_forged": 0, "poisoned_loads": 0, "slot_leaks": 0,
           "_accepted_with_trust_unsigned": {}, "_poisoned_with_trust_unsigned": {}, "_refusals": {}}
    with tempfile.TemporaryDirectory(prefix="kvtier-faults-poison-", dir=directory) as tmp:
        root = Path(tmp)
        world = World(root)
        admin = LocalAdmin(world.engine, root / "run" / "admin.sock", snapshot_dir=world.snapshots).start()
        client = AdminClient(str(root / "run" / "admin.sock"), timeout=60)
        try:
            tokens = _tokens(1, 4)
            keys = chain_block_hashes(tokens, SHAPE[3])
            world.put(keys, range(4))
            world.engine.manager.planner.record_session("victim", world.ns, keys, len(tokens), token_ids=tokens)
            world.engine.store("victim", world.ns, keys, [0, 1, 2, 3], len(tokens))
            genuine = Path(client.wait(client.post("/v1/sessions/victim/snapshot", {}))["path"])
            data = genuine.read_bytes()
            other_keys = chain_block_hashes(_tokens(2, 4), SHAPE[3])
            other_payload = bytes(reference_block(other_keys[0], world.geometry).reshape(-1).view(torch.uint8)
                                  .numpy()) * 2
            forged_dir = root / "forged"
            forged_dir.mkdir()

            def victim_clean() -> None:
                client.wait(client.post("/v1/sessions/victim/evict", {"to": "drop"}))

            def victim_poisoned() -> bool:
                loaded = world.engine.load(world.ns, keys, [40, 41, 42, 43])
                return bool(loaded and world.wrong(keys[:loaded], range(40, 40 + loaded)))

            victim_clean()
            paths = []
            for attempt in range(attempts):
                kind = POISON_KINDS[attempt % len(POISON_KINDS)]
                path = forged_dir / f"{attempt:04d}-{kind}.kvsnap"
                path.write_bytes(_forge(data, rng, kind, other_payload, other_keys))
                paths.append(path)
                out["poisoning_attempts"] += 1
                try:  # handed over as `kvtier restore FILE` does
                    client.wait(client.restore_file(path))
                    out["accepted_forged"] += 1
                except KvtierError as exc:
                    reason = exc.message.split(".kvsnap", 1)[-1].lstrip(" :")[:70]
                    out["_refusals"][reason] = out["_refusals"].get(reason, 0) + 1
                if victim_poisoned():
                    out["poisoned_loads"] += 1
                with contextlib.suppress(KvtierError):
                    victim_clean()
                # the operator vouching for the file (--trust-unsigned): recomputed keys still decide
                try:
                    client.wait(client.restore_file(path, {"trust_unsigned": True}))
                    out["_accepted_with_trust_unsigned"][kind] = out["_accepted_with_trust_unsigned"].get(kind, 0) + 1
                except KvtierError:
                    pass
                if victim_poisoned():  # what vouching for a forged file costs: only its own tokens' KV
                    out["_poisoned_with_trust_unsigned"][kind] = out["_poisoned_with_trust_unsigned"].get(kind, 0) + 1
                with contextlib.suppress(KvtierError):
                    victim_clean()
            progress(f"poisoning: {out['poisoning_attempts']} forged snapshots, {out['accepted_forged']} accepted")
            manager = world.engine.manager

            def usage() -> tuple:
                table = manager.table
                return table.slots.free_slots, len(table.index), table.nvme.used, len(table.sessions)

            before = usage()
            for i in range(refused_restores):
                with contextlib.suppress(KvtierError):
                    client.restore_file(paths[i % len(paths)])
            after = usage()
            out["slot_leaks"] = max(0, before[0] - after[0]) + max(0, after[1] - before[1])
            out["_usage_before_after"] = [before, after]
        finally:
            client.close()
            admin.stop()
            world.close()
    return out


# ---- paths a client names (issue 19) -------------------------------------------------------------------
def _escapes(snaps: Path, outside: Path) -> list[tuple[str, str, dict]]:
    """(label, route, body) of requests naming paths the server must not touch: outside its snapshot
    directory, through symlinks at every component, special files, over-long names."""
    snaps.mkdir(parents=True, exist_ok=True)
    outside.mkdir(parents=True, exist_ok=True)
    (outside / "loot.kvsnap").write_bytes(b"not yours")
    (snaps / "up").symlink_to(outside)  # a directory symlink leading out
    (snaps / "link.kvsnap").symlink_to(outside / "loot.kvsnap")  # a final-component symlink
    (snaps / "dangling.kvsnap").symlink_to(outside / "new.kvsnap")
    (snaps / "sub").mkdir()
    (snaps / "sub" / "deeper").symlink_to("/etc")
    os.mkfifo(snaps / "fifo.kvsnap")
    (snaps / "dir.kvsnap").mkdir()
    names = [str(outside / "loot.kvsnap"), str(outside / "new.kvsnap"), "/etc/passwd.kvsnap", "/dev/null.kvsnap",
             "../loot.kvsnap", "../../etc/x.kvsnap", "sub/../../loot.kvsnap", "up/loot.kvsnap", "up/new.kvsnap",
             str(snaps / "up" / "loot.kvsnap"), "link.kvsnap", "dangling.kvsnap", "sub/deeper/x.kvsnap",
             str(snaps / "sub" / "deeper" / "shadow.kvsnap"), "fifo.kvsnap", "dir.kvsnap",
             "x" * 300 + ".kvsnap", "a/" * 2100 + "x.kvsnap", "nul\0.kvsnap", "/proc/self/environ.kvsnap",
             str(snaps) + "/../" + outside.name + "/loot.kvsnap", "./up/./loot.kvsnap", "//etc//x.kvsnap",
             "/dev/zero", "/dev/stdin.kvsnap", "sub/deeper/../../../loot.kvsnap", "up/../up/loot.kvsnap",
             str(outside) + "/../" + snaps.name + "/../" + outside.name + "/new.kvsnap", "\u202e.kvsnap/..",
             "~/x.kvsnap"]
    cases = []
    for name in names:
        cases.append((f"snapshot {name[:40]}", "/v1/sessions/victim/snapshot", {"path": name}))
        cases.append((f"restore {name[:40]}", "/v1/restore", {"path": name}))
        cases.append((f"restore unsigned {name[:40]}", "/v1/restore", {"path": name, "trust_unsigned": True}))
    for n in range(10):  # a symlink at each depth of a path inside the snapshot directory
        deep = snaps.joinpath(*[f"d{i}" for i in range(n)])
        deep.mkdir(parents=True, exist_ok=True)
        (deep / f"s{n}").symlink_to(outside)
        rel = "/".join([*(f"d{i}" for i in range(n)), f"s{n}", "loot.kvsnap"])
        cases.append((f"symlink at depth {n}", "/v1/restore", {"path": rel}))
        cases.append((f"symlink at depth {n} (write)", "/v1/sessions/victim/snapshot", {"path": rel}))
    return cases


def run_path_escapes(directory: Path | None = None, progress: Callable[[str], None] = print) -> dict:
    """Every way of naming a file outside the snapshot directory, or a special file in it, sent to a
    real admin server: none may be opened, created or written, and none may block a request."""
    from kvtier.control.client import AdminClient
    from kvtier.control.local import LocalAdmin
    from kvtier.errors import KvtierError
    from kvtier.plan.index import chain_block_hashes

    out = {"path_escapes_tried": 0, "path_escapes": 0, "blocked_requests": 0, "_escaped": [], "_slowest_s": 0.0}
    with tempfile.TemporaryDirectory(prefix="kvtier-faults-paths-", dir=directory) as tmp:
        root = Path(tmp)
        world = World(root / "world")
        snaps = root / "snaps"
        admin = LocalAdmin(world.engine, root / "run" / "admin.sock", snapshot_dir=snaps).start()
        client = AdminClient(str(root / "run" / "admin.sock"), timeout=10)
        try:
            tokens = _tokens(3, 2)
            keys = chain_block_hashes(tokens, SHAPE[3])
            world.put(keys, range(2))
            world.engine.store("victim", world.ns, keys, [0, 1], len(tokens), token_ids=tokens)
            outside = root / "outside"
            cases = _escapes(snaps, outside)
            before = sorted(p.name for p in outside.iterdir())
            loot = (outside / "loot.kvsnap").read_bytes()
            for label, route, body in cases:
                out["path_escapes_tried"] += 1
                started = time.monotonic()
                try:
                    job = client.post(route, body)
                    if job.get("state") in ("queued", "running", "done"):
                        client.wait(job, timeout=10)
                        out["path_escapes"] += 1
                        out["_escaped"].append(label)
                except KvtierError:
                    pass
                took = time.monotonic() - started
                out["_slowest_s"] = max(out["_slowest_s"], took)
                if took > 2.0:
                    out["blocked_requests"] += 1
            # nothing outside was created or changed, whatever the server answered
            if sorted(p.name for p in outside.iterdir()) != before or (outside / "loot.kvsnap").read_bytes() != loot:
                out["path_escapes"] += 1
                out["_escaped"].append("a file outside the snapshot directory changed")
            progress(f"paths: {out['path_escapes_tried']} escapes tried, {out['path_escapes']} got through")
        finally:
            client.close()
            admin.stop()
            world.close()
    return out
