"""Trust in restored KV (issue 19): a snapshot decides nothing about where its KV goes.

The engine recomputes every block key from the file's token ids with its own hash and uses its own
namespace; a file that disagrees -- forged keys, another tenant's namespace, token ids that do not
cover its blocks -- is refused before any DRAM slot, index row or NVMe byte is taken. Files here are
real snapshots written by a real TierEngine, then rewritten the way a forger would (valid header and
payload checksums).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import xxhash
from support.engine import make_engine

from kvtier.errors import SnapshotError
from kvtier.plan.index import Tier, chain_block_hashes, namespace_of

BT = 16
_PREAMBLE = struct.Struct("<8sHHQQQQ")


def tokens_of(seed: int, blocks: int) -> list[int]:
    return list(range(seed * 10_000, seed * 10_000 + blocks * BT))


def take_snapshot(engine, tmp_path, name="agent", seed=1, blocks=4, salt=None):
    tokens = tokens_of(seed, blocks)
    keys = chain_block_hashes(tokens, BT)
    ns = namespace_of(engine.fingerprint.digest, salt)
    engine.manager.planner.record_session(name, ns, keys, len(tokens), token_ids=tokens)
    engine.store(name, ns, keys, list(range(blocks)), len(tokens))
    path = tmp_path / f"{name}.kvsnap"
    assert engine.snapshot(name, path).ok
    return path, keys, tokens


def rewrite_header(path, mutate) -> None:
    """Change a snapshot's JSON header as a forger would, keeping every checksum valid."""
    data = bytearray(path.read_bytes())
    magic, version, flags, header_len, _sum, payload_offset, file_len = _PREAMBLE.unpack_from(data)
    doc = json.loads(bytes(data[64:64 + header_len]))
    mutate(doc)
    header = json.dumps(doc).encode()
    assert len(header) <= header_len, "the forged header must fit the reserved space"
    header = header.ljust(header_len, b" ")
    data[64:64 + header_len] = header
    _PREAMBLE.pack_into(data, 0, magic, version, flags, header_len, xxhash.xxh3_64_intdigest(header),
                        payload_offset, file_len)
    path.write_bytes(bytes(data))


def fresh(fingerprint, hbm, tmp_path, name="restorer"):
    return make_engine(fingerprint, hbm, tmp_path / name, dram_blocks=16)


def usage(engine) -> tuple:
    manager = engine.manager
    table = manager.table
    return table.slots.free_slots, len(table.index), table.nvme.used, len(table.sessions)


def test_a_genuine_snapshot_restores_under_recomputed_keys(fingerprint, hbm, tmp_path):
    source = make_engine(fingerprint, hbm, tmp_path / "source", dram_blocks=16)
    path, keys, _tokens = take_snapshot(source, tmp_path)
    reference = [layer[0:4].clone() for layer in hbm]
    source.close()
    engine = fresh(fingerprint, hbm, tmp_path)
    assert engine.restore(path).ok
    ns = namespace_of(fingerprint.digest)
    assert engine.load(ns, keys, list(range(20, 24))) == 4
    assert all(torch.equal(layer[20:24], ref) for layer, ref in zip(hbm, reference))
    engine.close()


FORGERIES = {
    "a block key swapped for another prefix's": lambda d: d["blocks"][1].__setitem__(
        "key", chain_block_hashes(tokens_of(9, 2), BT)[1].hex()),
    "the token ids changed under the same keys": lambda d: d.__setitem__(
        "token_ids", [t + 1 for t in d["token_ids"]]),
    "one token id changed": lambda d: d["token_ids"].__setitem__(40, 7),
    "token ids cut short": lambda d: d.__setitem__("token_ids", d["token_ids"][:BT * 2]),
    "no token ids at all": lambda d: d.__setitem__("token_ids", []),
    "another tenant's namespace": lambda d: d.__setitem__("namespace", namespace_of(b"x" * 16, "other").hex()),
    "keys reordered": lambda d: d["blocks"].__setitem__(0, {**d["blocks"][0], "key": d["blocks"][2]["key"]}),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forged_snapshot_is_refused_and_takes_nothing(fingerprint, hbm, tmp_path, forgery):
    source = make_engine(fingerprint, hbm, tmp_path / "source", dram_blocks=16)
    path, keys, _tokens = take_snapshot(source, tmp_path)
    source.close()
    rewrite_header(path, FORGERIES[forgery])
    engine = fresh(fingerprint, hbm, tmp_path)
    before = usage(engine)
    with pytest.raises(SnapshotError) as err:
        engine.restore(path)
    assert "refused" in err.value.message and err.value.hint
    assert usage(engine) == before  # no slot, row, NVMe byte or session taken
    assert engine.load(namespace_of(fingerprint.digest), keys, [20, 21, 22, 23]) == 0
    engine.close()


def test_another_hash_scheme_restores_under_this_engines_keys(fingerprint, hbm, tmp_path):
    """A snapshot taken with another hash (a vLLM upgrade, --prefix-caching-hash-algo changed):
    its keys cannot be checked, and are not used -- its blocks go under this engine's keys."""
    source = make_engine(fingerprint, hbm, tmp_path / "source", dram_blocks=16)
    path, keys, _tokens = take_snapshot(source, tmp_path)
    source.close()

    def other_hash(doc):
        doc["meta"]["key_scheme"] = "vllm:xxhash:0123456789abcdef"
        for i, block in enumerate(doc["blocks"]):
            block["key"] = (bytes([i + 1]) * 32).hex()

    rewrite_header(path, other_hash)
    engine = fresh(fingerprint, hbm, tmp_path)
    assert engine.restore(path).ok
    ns = namespace_of(fingerprint.digest)
    assert engine.load(ns, keys, [20, 21, 22, 23]) == 4  # found under the recomputed keys
    assert engine.load(ns, [bytes([1]) * 32], [24]) == 0  # never under the file's
    engine.close()


def test_a_salted_tenants_snapshot_needs_its_salt(fingerprint, hbm, tmp_path):
    source = make_engine(fingerprint, hbm, tmp_path / "source", dram_blocks=16)
    path, keys, _tokens = take_snapshot(source, tmp_path, salt="tenant-a")
    source.close()
    engine = fresh(fingerprint, hbm, tmp_path)
    from kvtier.persist.snapshot import open_snapshot

    with pytest.raises(SnapshotError, match="namespace is not this engine's"):
        engine.manager.planner.prepare_restore(open_snapshot(path))
    with pytest.raises(SnapshotError):
        engine.manager.planner.prepare_restore(open_snapshot(path), Tier.DRAM, "tenant-b")
    job = engine.manager.planner.prepare_restore(open_snapshot(path), Tier.DRAM, "tenant-a")
    assert engine.execute(job).ok
    assert engine.load(namespace_of(fingerprint.digest, "tenant-a"), keys, [20, 21, 22, 23]) == 4
    engine.close()


def test_an_invalid_session_id_is_refused_before_anything_is_taken(fingerprint, hbm, tmp_path):
    from kvtier.errors import KvtierError

    source = make_engine(fingerprint, hbm, tmp_path / "source", dram_blocks=16)
    path, _keys, _tokens = take_snapshot(source, tmp_path)
    source.close()
    rewrite_header(path, lambda d: d.__setitem__("session_id", "../../etc/passwd"))
    engine = fresh(fingerprint, hbm, tmp_path)
    before = usage(engine)
    for _ in range(200):  # a client retrying a bad file must not drain the pool
        with pytest.raises(KvtierError):
            engine.restore(path)
    assert usage(engine) == before
    engine.close()


def test_a_header_larger_than_any_session_here_is_not_parsed(fingerprint, hbm, tmp_path):
    from kvtier.persist.snapshot import open_snapshot

    source = make_engine(fingerprint, hbm, tmp_path / "source", dram_blocks=16)
    path, _keys, _tokens = take_snapshot(source, tmp_path)
    source.close()
    # the same valid file, its header padded to 8 MiB (JSON allows trailing spaces)
    data = path.read_bytes()
    magic, version, flags, header_len, _sum, payload_offset, file_len = _PREAMBLE.unpack_from(data)
    payload = data[payload_offset:file_len]
    size = 8 << 20
    offset = -(-(64 + size) // 4096) * 4096  # page aligned
    doc = json.loads(data[64:64 + header_len])
    for block in doc["blocks"]:
        block["offset"] += offset - payload_offset
    header = json.dumps(doc).encode().ljust(size, b" ")
    preamble = _PREAMBLE.pack(magic, version, flags, size, xxhash.xxh3_64_intdigest(header), offset,
                              offset + len(payload)).ljust(64, b"\0")
    path.write_bytes((preamble + header).ljust(offset, b"\0") + payload)
    assert len(open_snapshot(path).blocks) == 4  # valid: a reader without a cap takes it
    engine = fresh(fingerprint, hbm, tmp_path)  # 16 DRAM slots + 64 NVMe blocks: headers of ~1 MiB at most
    with pytest.raises(SnapshotError, match="larger than any session"):
        open_snapshot(path, engine.manager.planner.max_snapshot_header())
    engine.close()


# ---- signatures: where a snapshot came from ------------------------------------------------------------
@pytest.fixture
def keys(tmp_path, monkeypatch):
    path = tmp_path / "config" / "snapshot-keys"
    monkeypatch.setenv("KVTIER_SNAPSHOT_KEYS", str(path))
    return path


@pytest.fixture
def served(fingerprint, hbm, tmp_path, keys):
    """A real admin server (Unix socket) over an engine holding one session."""
    from kvtier.control.client import AdminClient
    from kvtier.control.local import LocalAdmin

    engine = make_engine(fingerprint, hbm, tmp_path / "served", dram_blocks=16)
    tokens = tokens_of(1, 4)
    keys_ = chain_block_hashes(tokens, BT)
    ns = namespace_of(fingerprint.digest)
    engine.manager.planner.record_session("agent", ns, keys_, len(tokens), token_ids=tokens)
    engine.store("agent", ns, keys_, [0, 1, 2, 3], len(tokens))
    admin = LocalAdmin(engine, tmp_path / "run" / "a.sock", snapshot_dir=tmp_path / "snaps").start()
    admin.client = AdminClient(str(tmp_path / "run" / "a.sock"))
    admin.keys = keys_
    yield admin
    admin.stop()
    engine.close(write_back=False)


def snapshot_through(served) -> str:
    job = served.client.wait(served.client.post("/v1/sessions/agent/snapshot", {}))
    assert job["state"] == "done", job
    served.client.wait(served.client.post("/v1/sessions/agent/evict", {"to": "drop"}))
    return job["path"]


def restore_through(served, path, **extra) -> dict:
    return served.client.wait(served.client.post("/v1/restore", {"path": path, **extra}))


def test_the_server_signs_its_snapshots_and_restores_them(served, keys):
    from kvtier.persist.snapshot import open_snapshot
    from kvtier.persist.trust import load_keys

    path = snapshot_through(served)
    assert keys.exists() and (keys.stat().st_mode & 0o777) == 0o600  # made on first use, private
    assert open_snapshot(path, trusted_keys=load_keys()).signed is True
    assert open_snapshot(path, trusted_keys=[b"k" * 32]).signed is False
    assert restore_through(served, path)["state"] == "done"
    assert served.engine.load(namespace_of(served.engine.fingerprint.digest), served.keys, [20, 21, 22, 23]) == 4


def test_a_tampered_or_foreign_snapshot_needs_the_operators_word(served, keys, tmp_path):
    from kvtier.errors import KvtierError

    path = snapshot_through(served)
    before = usage(served.engine)
    rewrite_header(Path(path), lambda d: d.__setitem__("created", 1.0))  # checksums redone
    with pytest.raises(KvtierError) as err:
        restore_through(served, path)
    assert "not signed by a key this server trusts" in err.value.message and "--trust-unsigned" in err.value.hint
    assert usage(served.engine) == before
    # the operator vouches for it: its keys are still recomputed, and it restores
    assert restore_through(served, path, trust_unsigned=True)["state"] == "done"


def test_another_boxs_snapshot_restores_once_its_key_is_trusted(served, keys, fingerprint, hbm, tmp_path,
                                                               monkeypatch):
    from kvtier.errors import KvtierError

    other = tmp_path / "other-box-keys"
    monkeypatch.setenv("KVTIER_SNAPSHOT_KEYS", str(other))  # the other box signs with its own key
    path = snapshot_through(served)
    monkeypatch.setenv("KVTIER_SNAPSHOT_KEYS", str(keys))
    keys.parent.mkdir(parents=True, exist_ok=True)
    keys.write_text("# this box\n" + "ab" * 32 + "\n")
    keys.chmod(0o600)
    with pytest.raises(KvtierError, match="not signed by a key"):
        restore_through(served, path)
    keys.write_text(keys.read_text() + other.read_text())  # the operator copies the other box's key in
    assert restore_through(served, path)["state"] == "done"
    keys.chmod(0o644)
    with pytest.raises(KvtierError, match="can be read by other users"):
        restore_through(served, path)


# ---- paths: the server touches only its snapshot directory, or a file the client hands over ---------------
def test_no_path_a_client_names_escapes_the_snapshot_directory(tmp_path):
    from benchmarks.faults.suite import run_path_escapes

    out = run_path_escapes(directory=tmp_path, progress=lambda _m: None)
    assert out["path_escapes_tried"] >= 100
    assert (out["path_escapes"], out["blocked_requests"]) == (0, 0), out["_escaped"]


def test_snapshot_out_where_the_user_stands_and_restore_hand_the_file_over(served, tmp_path, monkeypatch):
    """`kvtier snapshot S --out ./x.kvsnap` outside the server's snapshot directory: the CLI makes the
    file and hands it over; `kvtier restore ./x.kvsnap` hands it over too. Nothing is left behind."""
    from typer.testing import CliRunner

    from kvtier.cli.main import app
    from kvtier.persist.snapshot import open_snapshot
    from kvtier.persist.trust import load_keys

    here = tmp_path / "work"
    here.mkdir()
    monkeypatch.chdir(here)
    runner = CliRunner()
    sock = str(tmp_path / "run" / "a.sock")
    taken = runner.invoke(app, ["snapshot", "agent", "--out", "./agent.kvsnap", "--json", "--socket", sock])
    assert taken.exit_code == 0, taken.output
    assert json.loads(taken.output)["path"] == str(here / "agent.kvsnap")
    assert sorted(p.name for p in here.iterdir()) == ["agent.kvsnap"]  # no temp file left
    assert open_snapshot(here / "agent.kvsnap", trusted_keys=load_keys()).signed
    assert runner.invoke(app, ["evict", "agent", "--to", "drop", "--yes", "--socket", sock]).exit_code == 0
    restored = runner.invoke(app, ["restore", "./agent.kvsnap", "--json", "--socket", sock])
    assert restored.exit_code == 0, restored.output
    assert json.loads(restored.output)["state"] == "done"
    assert served.engine.load(namespace_of(served.engine.fingerprint.digest), served.keys, [20, 21, 22, 23]) == 4
    # the same path named to the server (not handed over) is refused: it is outside its directory
    from kvtier.errors import KvtierError

    with pytest.raises(KvtierError, match="outside the server's snapshot directory"):
        served.client.post("/v1/restore", {"path": str(here / "agent.kvsnap")})
    # an existing file that is not a snapshot is never overwritten
    (here / "notes.kvsnap").write_text("mine")
    refused = runner.invoke(app, ["snapshot", "agent", "--out", "notes.kvsnap", "--socket", sock])
    assert refused.exit_code == 2 and "not a kvtier snapshot" in refused.stderr
    assert (here / "notes.kvsnap").read_text() == "mine"


def test_special_files_are_refused_without_blocking(served, tmp_path, monkeypatch):
    import os
    import time

    from typer.testing import CliRunner

    from kvtier.cli.main import app

    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "fifo.kvsnap")
    sock = str(tmp_path / "run" / "a.sock")
    for name in ("fifo.kvsnap", "/dev/null"):
        started = time.monotonic()
        result = CliRunner().invoke(app, ["restore", name, "--socket", sock])
        assert time.monotonic() - started < 2
        assert result.exit_code == 2 and "not a regular file" in result.stderr, result.output
