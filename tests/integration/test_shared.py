"""The shared tier against a real redis-server that each test starts itself (standalone on a loopback
port or a Unix socket, with a password, or a 3-node cluster): blocks and sessions that cross from
one engine ("box") to another, values that must never be served, and a store that is down, paused,
full or refusing our credentials -- none of which may fail or hold up anything."""
from __future__ import annotations

import os
import shutil
import time

import pytest
import torch
from support.clock import FakeClock
from support.engine import make_engine
from support.realpath import in_ci

from kvtier.plan.index import chain_block_hashes, namespace_of

if shutil.which("redis-server") is None and shutil.which("valkey-server") is None:
    if in_ci():  # CI installs it: a missing server fails there
        raise RuntimeError("a CI run (KVTIER_CI=1) and there is no redis-server")
    pytest.skip("no redis-server (apt-get install redis-server)", allow_module_level=True)

from benchmarks.redisproc import RedisServer, start_cluster  # noqa: E402
from kvtier.errors import ConfigError, UsageError  # noqa: E402
from kvtier.tiers.shared.config import SharedConfig, load_credentials, parse_shared_url  # noqa: E402
from kvtier.tiers.shared.store import SharedStore, SharedUnavailable, block_key  # noqa: E402


@pytest.fixture
def redis_server(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        yield server


def two_boxes(fingerprint, tmp_path, url, **config):
    """Two engines with their own DRAM, NVMe and 'HBM' tensors, one shared store."""
    from kvtier.layout import CpuLayout

    def layers(seed):
        torch.manual_seed(seed)
        shape = CpuLayout(fingerprint.geometry).layer_shape(64)
        return [torch.randn(shape).to(torch.bfloat16) for _ in range(fingerprint.geometry.num_layers)]

    shared = SharedConfig(url, **config)
    a = make_engine(fingerprint, layers(1), tmp_path / "a", shared=shared, box="a")
    b = make_engine(fingerprint, layers(2), tmp_path / "b", shared=shared, box="b")
    return a, b


def same_blocks(a, b, a_blocks, b_blocks) -> bool:
    return all(torch.equal(la[i], lb[j]) for la, lb in zip(a.mover.copies.kv_layers, b.mover.copies.kv_layers)
               for i, j in zip(a_blocks, b_blocks))


def session(n_blocks=6, start=0, bt=16):
    tokens = list(range(start, start + n_blocks * bt))
    return tokens, chain_block_hashes(tokens, bt)


def published(box, fingerprint, session_id="agent"):
    """A 6-block session stored on ``box`` and published: (namespace, token ids, keys)."""
    ns = namespace_of(fingerprint.digest)
    tokens, keys = session()
    box.store(session_id, ns, keys, list(range(6)), len(tokens), token_ids=tokens)
    box.publish()
    return ns, tokens, keys


# ---- configuration -------------------------------------------------------------------------------
def test_the_tiers_behind_dram_share_one_interface(tmp_path):
    from kvtier.tiers.base import BlockStore
    from kvtier.tiers.nvme.store import NvmeStore

    nvme = NvmeStore(tmp_path / "nvme", 1 << 20)
    try:
        assert isinstance(nvme, BlockStore) and nvme.name == "nvme"
        assert isinstance(SharedStore(SharedConfig("redis://127.0.0.1:1/0")), BlockStore)
    finally:
        nvme.close()


def test_urls_are_checked_and_a_password_in_one_is_refused():
    assert parse_shared_url("redis://10.0.0.5:6379/0") == "redis://10.0.0.5:6379/0"
    assert parse_shared_url("valkey://h:1/2") == "redis://h:1/2"
    assert parse_shared_url("unix:///run/valkey.sock").startswith("unix://")
    with pytest.raises(UsageError) as err:
        parse_shared_url("redis://:hunter2@10.0.0.5:6379/0")
    assert "hunter2" not in str(err.value) and "--shared-auth-file" in err.value.hint
    for bad in ("http://h:1", "redis://", "redis://h:99999", "redis://h:1/x", "unix://"):
        with pytest.raises(UsageError):
            parse_shared_url(bad)


def test_credentials_come_from_a_private_file_or_the_environment(tmp_path):
    secret = tmp_path / "auth"
    secret.write_text("kvtier\ns3cret\n")
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600|read by other users"):
        load_credentials(str(secret), {})
    secret.chmod(0o600)
    assert load_credentials(str(secret), {}) == ("kvtier", "s3cret")
    assert load_credentials(None, {"KVTIER_SHARED_PASSWORD": "pw"}) == (None, "pw")
    with pytest.raises(ConfigError):
        load_credentials(str(tmp_path / "missing"), {})


def test_settings_refuse_a_bad_shared_url_without_echoing_it():
    from dataclasses import replace

    from kvtier.config import Settings, validate_settings

    with pytest.raises(ConfigError) as err:
        validate_settings(replace(Settings(), shared="redis://:topsecret@h:1"))
    assert "topsecret" not in str(err.value)


# ---- the store -----------------------------------------------------------------------------------
def test_blocks_cross_boxes_bit_for_bit_and_sessions_are_listed(fingerprint, tmp_path, redis_server):
    a, b = two_boxes(fingerprint, tmp_path, redis_server.url)
    try:
        ns = namespace_of(fingerprint.digest)
        tokens, keys = session()
        assert a.store("agent", ns, keys, list(range(6)), len(tokens), token_ids=tokens) == 6
        assert a.publish() == 1
        listed = b.shared.sessions.list_sessions(fingerprint.digest)
        assert [(s["session_id"], s["box"], s["blocks"]) for s in listed] == [("agent", "a", 6)]
        assert b.fetch(ns, keys) == 6
        assert b.load(ns, keys, list(range(20, 26))) == 6
        assert same_blocks(a, b, range(6), range(20, 26))
        assert b.manager.telemetry.counters["fetched_blocks"] == 6
    finally:
        a.close(), b.close()


def test_a_missing_or_evicted_key_is_a_miss_and_the_prefix_before_it_still_fetches(fingerprint, tmp_path,
                                                                                   redis_server):
    a, b = two_boxes(fingerprint, tmp_path, redis_server.url)
    try:
        ns, tokens, keys = published(a, fingerprint)
        redis_server.client().delete(block_key(ns, keys[3]))  # what the store's own eviction does
        assert b.fetch(ns, keys) == 3
        assert b.load(ns, keys, list(range(20, 26))) == 3
    finally:
        a.close(), b.close()


def test_other_models_and_tenants_never_share_a_block(fingerprint, geometry, tmp_path, redis_server):
    from dataclasses import replace

    from kvtier.layout import ModelFingerprint

    a, _b = two_boxes(fingerprint, tmp_path, redis_server.url)
    other_model = ModelFingerprint("other-model", geometry)
    tokens, keys = session()
    try:
        ns, tokens, keys = published(a, fingerprint)
        store = SharedStore(SharedConfig(redis_server.url))
        salted = namespace_of(fingerprint.digest, "tenant-b")
        assert store.blocks.lengths(salted, keys) == [0] * 6  # another tenant's namespace: nothing there
        dst = torch.empty(geometry.block_bytes * 2, dtype=torch.uint8)
        # the right key read as another model: refused by the header, never copied out
        outcome = store.read_batch([(ns, keys[0], dst)], other_model.digest)[0]
        assert isinstance(outcome, Exception) and "another model" in str(outcome)
        assert replace(fingerprint).digest == fingerprint.digest
        assert store.sessions.list_sessions(other_model.digest) == []
    finally:
        a.close(), _b.close()


def test_forged_and_damaged_values_are_never_served(redis_server):
    """The benchmark's forgeries (random, truncated, flipped, another key's, namespace's, model's or
    rank's value, a lying length, unsigned, signed by an unknown key, empty) through the tier and an
    engine's FETCH job."""
    from benchmarks.shared import FORGERIES, run_foreign_values

    results = run_foreign_values(redis_server.url, per_kind=8, progress=lambda _: None)
    assert results["_foreign_values_tried"] == 8 * len(FORGERIES) + 64
    assert results["foreign_values_served"] == 0


def test_a_valid_value_signed_by_this_box_is_served(redis_server, geometry):
    store = SharedStore(SharedConfig(redis_server.url))
    payload = torch.randint(0, 256, (geometry.block_bytes,), dtype=torch.uint8)
    ns, key, fp = os.urandom(16), os.urandom(32), os.urandom(16)
    assert store.write_batch([(ns, key, payload, "none")], fp) == [None]
    dst = torch.empty_like(payload)
    assert store.read_batch([(ns, key, dst)], fp) == [(geometry.block_bytes, "none")]
    assert torch.equal(dst, payload)
    # a list under a block's key, a missing key and a value too big for its destination, in one
    # pipeline with good ones: each is refused or missed on its own, the good ones still read
    client = redis_server.client()
    odd, missing, big = os.urandom(32), os.urandom(32), os.urandom(32)
    client.rpush(block_key(ns, odd), b"x")
    store.write_batch([(ns, big, torch.zeros(geometry.block_bytes * 2, dtype=torch.uint8), "none")], fp)
    dsts = [torch.empty_like(payload) for _ in range(5)]
    outcomes = store.read_batch([(ns, k, d) for k, d in zip([key, odd, missing, big, key], dsts)], fp)
    assert outcomes[0] == outcomes[4] == (geometry.block_bytes, "none")
    assert torch.equal(dsts[4], payload)
    assert "not a kvtier block" in str(outcomes[1]) or "too short" in str(outcomes[1])
    assert "not stored" in str(outcomes[2]) and "destination" in str(outcomes[3])
    assert store.state == "ok" and client.exists(block_key(ns, odd)) == 0  # refused values are removed


def test_a_published_session_is_restored_with_its_keys_recomputed(fingerprint, tmp_path, redis_server):
    a, b = two_boxes(fingerprint, tmp_path, redis_server.url)
    try:
        ns, tokens, keys = published(a, fingerprint)
        entry = b.shared.sessions.session_entry(fingerprint.digest, "agent")
        assert b.manager.planner.shared_entry_keys(entry) == (ns, keys)
        forged = dict(entry, token_ids=list(range(1000, 1000 + len(tokens))))  # keys no longer match
        with pytest.raises(Exception, match="not the hash of its tokens"):
            b.manager.planner.shared_entry_keys(forged)
        with pytest.raises(Exception, match="another namespace"):
            b.manager.planner.shared_entry_keys(entry, cache_salt="tenant-b")
    finally:
        a.close(), b.close()


# ---- faults --------------------------------------------------------------------------------------
def _timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def test_a_store_that_is_down_paused_or_restarted_costs_nothing_and_recovers(fingerprint, tmp_path, redis_server):
    a, b = two_boxes(fingerprint, tmp_path, redis_server.url, timeout_s=0.3)
    ns = namespace_of(fingerprint.digest)
    try:
        tokens, keys = session()
        for fault in ("stop", "pause"):
            redis_server.stop() if fault == "stop" else redis_server.pause()
            # a store with the server gone: the first call waits its timeout at most, later ones not at all
            stored, took = _timed(lambda: a.store(f"s-{fault}", ns, keys, list(range(6)), len(tokens),
                                                  token_ids=tokens))
            assert stored in (0, 6) and took < 2.0
            a.publish(timeout=5)
            assert a.shared.state == "down" and a.shared.problem
            fetched, took = _timed(lambda: b.fetch(ns, keys))
            assert fetched == 0 and took < 1.0
            fetched, took = _timed(lambda: b.fetch(ns, keys))
            assert fetched == 0 and took < 0.05  # inside the back-off: not even tried
            redis_server.start() if fault == "stop" else redis_server.resume()
            a.shared.client.retry_now(), b.shared.client.retry_now()  # the back-off over (timing: the FakeClock test)
            tokens, keys = session(start=1000 if fault == "stop" else 2000)
            assert a.store(f"s2-{fault}", ns, keys, list(range(6)), len(tokens), token_ids=tokens) == 6
            assert a.mover.publisher.drain()
            assert b.fetch(ns, keys) == 6
            assert b.shared.state == "ok" and a.shared.state == "ok"
            assert b.shared.counters["recoveries"] >= 1
    finally:
        redis_server.resume()
        a.close(), b.close()


def test_the_back_off_doubles_to_its_longest_and_ends_on_the_clock(tmp_path):
    clock = FakeClock()
    with RedisServer(tmp_path / "redis") as server:
        store = SharedStore(SharedConfig(server.url, timeout_s=0.3), clock=clock)
        store.client.ping()
        server.stop()
        for delay in (0.5, 1.0, 2.0, 4.0, 8.0, 8.0):  # BACKOFF_MIN_S doubling to BACKOFF_MAX_S
            pytest.raises(SharedUnavailable, store.client.ping)  # tried: the store is gone
            clock.advance(delay - 0.01)
            assert store.state == "down" and "unreachable" in store.problem and not store.available
            clock.advance(0.01)
            assert store.available
        assert store.counters["errors"] == 6
        server.start()
        assert store.client.ping() > 0 and store.state == "ok" and store.counters["recoveries"] == 1
        server.stop()
        pytest.raises(SharedUnavailable, store.client.ping)
        assert store.client.backoff.delay == 0.5 and not store.available  # a success started it over
        store.client.retry_now()  # the operator ends it at once
        assert store.available


def wait_for_sessions(server, wanted: set[str], timeout: float) -> bool:
    """Whether the ``wanted`` sessions were published, with every block of theirs in the store too,
    within ``timeout`` s: looked for again after each write to a kvtier key (the store's keyspace
    notifications: a wait on an event, not a sleep). The index is read as it is, never tidied."""
    client, store = server.client(), SharedStore(SharedConfig(server.url))
    client.config_set("notify-keyspace-events", "K$zg")
    pubsub = client.pubsub()
    pubsub.psubscribe("__keyspace@*__:kvt1:*")
    pubsub.get_message(timeout=5)  # subscribed: no write after this goes unseen

    def stored() -> set[str]:
        entries = [store.sessions.session_entry(bytes.fromhex(index.decode().rsplit(":", 1)[1]), session_id.decode())
                   for index in client.keys(b"kvt1:sessions:*") for session_id in client.zrange(index, 0, -1)]
        return {e["session_id"] for e in entries
                if e is not None and e["keys"] and all(store.blocks.lengths(e["namespace"], e["keys"]))}

    deadline = time.monotonic() + timeout
    while not (ok := wanted <= stored()) and time.monotonic() < deadline:
        pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))  # the next write
        while pubsub.get_message(timeout=0) is not None:  # a burst of writes: one more look
            pass
    pubsub.close(), client.close(), store.close()
    return ok


def test_wrong_credentials_and_a_full_store_are_reported_not_raised(tmp_path, geometry):
    with RedisServer(tmp_path / "auth", password="right-one", maxmemory="2mb") as server:
        wrong = SharedStore(SharedConfig(server.url), env={"KVTIER_SHARED_PASSWORD": "wrong"})
        with pytest.raises(SharedUnavailable):
            wrong.client.ping()
        assert wrong.state == "down" and "credentials" in wrong.problem
        payload = torch.zeros(geometry.block_bytes, dtype=torch.uint8)
        assert isinstance(wrong.write_batch([(b"n" * 16, b"k" * 32, payload, "none")], b"f" * 16)[0], Exception)

        secret = tmp_path / "pw"
        secret.write_text("right-one\n")
        secret.chmod(0o600)
        right = SharedStore(SharedConfig(server.url, auth_file=str(secret)))
        big = torch.zeros(1 << 20, dtype=torch.uint8)
        outcomes = right.write_batch([(b"n" * 16, os.urandom(32), big, "none") for _ in range(4)], b"f" * 16)
        assert any(isinstance(o, Exception) for o in outcomes)  # noeviction + maxmemory: OOM
        assert right.state == "down" and "full" in right.problem


def test_unix_socket_store(tmp_path, geometry):
    with RedisServer(tmp_path / "unix", unix=True) as server:
        store = SharedStore(SharedConfig(server.url))
        payload = torch.randint(0, 256, (geometry.block_bytes,), dtype=torch.uint8)
        assert store.write_batch([(b"n" * 16, b"k" * 32, payload, "none")], b"f" * 16) == [None]
        assert store.blocks.lengths(b"n" * 16, [b"k" * 32]) == [geometry.block_bytes]


def test_a_three_node_cluster_spreads_blocks_and_serves_them(fingerprint, tmp_path):
    nodes = start_cluster(tmp_path / "cluster", 3)
    try:
        a, b = two_boxes(fingerprint, tmp_path, nodes[0].url)
        try:
            ns = namespace_of(fingerprint.digest)
            tokens, keys = session(n_blocks=24)
            a.store("agent", ns, keys[:8], list(range(8)), 8 * 16, token_ids=tokens[: 8 * 16])
            a.publish()
            assert b.fetch(ns, keys[:8]) == 8
            assert a.shared.client.cluster and b.shared.client.cluster
            assert b.load(ns, keys[:8], list(range(30, 38))) == 8
            assert same_blocks(a, b, range(8), range(30, 38))
            per_node = [n.client().dbsize() for n in nodes]
            assert sum(1 for count in per_node if count) >= 2  # not all on one node
        finally:
            a.close(), b.close()
    finally:
        for node in nodes:
            node.stop()


# ---- two real kvtier serve processes, one store ------------------------------------------------------
def test_two_servers_continue_each_others_sessions(tiny_model, tmp_path, monkeypatch):
    """Box A serves a session's turn; box B (its own DRAM and NVMe) lists it with `kvtier sessions
    --shared`, pulls it with `kvtier restore --shared`, and a second session's next turn sent straight
    to B loads its prefix from the store by itself, with A's exact output. Then the store goes away:
    B keeps serving and says so in status."""
    import json

    from typer.testing import CliRunner

    from kvtier.cli.main import app
    from kvtier.launch.served import Served

    runner = CliRunner()
    for key in list(os.environ):
        if key.startswith("KVTIER_") and key != "KVTIER_SNAPSHOT_KEYS":
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    server = RedisServer(tmp_path / "redis").start()
    args = ("--shared", server.url)
    a = Served(str(tiny_model), tmp_path, "a", 2048, nvme_dir=tmp_path / "nvme-a", instance="a", serve_args=args)
    b = None
    try:
        b = Served(str(tiny_model), tmp_path, "b", 2048, nvme_dir=tmp_path / "nvme-b", instance="b", serve_args=args)
        bt = int(b.admin().get("/v1/status")["block_tokens"])
        prompt = list(range(100, 100 + 5 * bt + 7))
        a.turn("agent", prompt)
        a.turn("agent2", prompt[::-1])
        # A publishes the entries (once a second) and the blocks (its worker's publisher) on its own
        assert wait_for_sessions(server, {"agent", "agent2"}, 60)
        out = runner.invoke(app, ["sessions", "--shared", "--json", "--instance", "b"])
        assert out.exit_code == 0, out.output
        listed = {s["session_id"]: s for s in json.loads(out.output)["sessions"]}
        assert listed["agent"]["box"] == "a" and listed["agent"]["blocks"] == 5
        human = runner.invoke(app, ["sessions", "--shared", "--instance", "b"])
        assert "agent2" in human.output and "shared sessions in" in human.output

        pulled = runner.invoke(app, ["restore", "agent", "--shared", "--instance", "b", "--json"])
        assert pulled.exit_code == 0, pulled.output + pulled.stderr
        job = json.loads(pulled.output)
        assert job["state"] == "done" and job["blocks_in_store"] == 5
        turn = prompt + list(range(1000, 1000 + bt))
        assert b.turn("agent", turn)["loaded"] >= 5 * bt

        turn2 = prompt[::-1] + list(range(1200, 1200 + bt))  # straight to B: found by the lookup
        here, there = b.turn("agent2", turn2), a.turn("ref", turn2)
        assert here["loaded"] >= 5 * bt and here["text"] == there["text"]
        status = b.admin().get("/v1/status")
        assert status["shared"]["state"] == "ok" and status["shared"]["fetched_blocks"] >= 10
        assert "shared tier: " + server.url.split("/0")[0] in runner.invoke(app, ["status", "--instance", "b"]).output
        missing = runner.invoke(app, ["restore", "nobody", "--shared", "--instance", "b"])
        assert missing.exit_code == 4 and "sessions --shared" in missing.stderr

        server.stop()  # the store is gone: B serves, warns, and recomputes what it would have fetched
        assert b.turn("agent3", list(range(900, 900 + 3 * bt)))["text"] is not None
        deadline = time.monotonic() + 15
        while "shared" not in b.admin().get("/v1/status")["warnings"] and time.monotonic() < deadline:
            # each turn asks the store (its lookup) and paces the loop; B's once-a-second upkeep
            # turns the failure into the warning
            b.turn("agent3", list(range(900, 900 + 3 * bt)) + [5])
        assert "serving without it" in b.admin().get("/v1/status")["warnings"]["shared"]
        down = runner.invoke(app, ["sessions", "--shared", "--instance", "b"])
        assert down.exit_code != 0 and "shared store" in down.stderr
    finally:
        if b is not None:
            b.stop()
        a.stop()
        server.stop()


def test_doctor_measures_the_shared_store_and_says_when_it_is_away(redis_server, tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from kvtier.cli.main import app

    monkeypatch.setenv("KVTIER_NVME_DIR", str(tmp_path / "nvme"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    runner = CliRunner()
    out = runner.invoke(app, ["doctor", "--quick", "--json", "--shared", redis_server.url])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["shared"]["read_gbps"] > 0 and report["shared"]["rtt_ms"] > 0
    assert report["reload_200k_s"]["shared"] > 0
    away = json.loads(runner.invoke(app, ["doctor", "--quick", "--json", "--shared", "redis://127.0.0.1:1/0"]).output)
    assert "unreachable" in away["shared"]["problem"] and any("serve without it" in w for w in away["warnings"])


def test_policies_ttl_and_serve_checks(fingerprint, tmp_path, redis_server):
    """write-through publishes on store, demote only once a block has its NVMe copy; every key has
    the TTL; serve refuses demote without an NVMe tier and warns (not refuses) when the store is away."""
    from dataclasses import replace

    from kvtier.config import Settings
    from kvtier.launch.serve import check_shared

    a, b = two_boxes(fingerprint, tmp_path, redis_server.url, policy="demote", ttl_s=600)
    client = redis_server.client()
    try:
        ns = namespace_of(fingerprint.digest)
        tokens, keys = session()
        a.store("agent", ns, keys, list(range(6)), len(tokens), token_ids=tokens)
        a.mover.publisher.drain()
        assert b.shared.blocks.lengths(ns, keys) == [0] * 6  # demote: not yet
        a.flush()  # the blocks get their NVMe copy
        a.mover.publisher.drain()
        assert all(b.shared.blocks.lengths(ns, keys))
        assert 0 < client.ttl(block_key(ns, keys[0])) <= 600
        a.publish()
        assert 0 < client.ttl(b"kvt1:s:" + fingerprint.digest.hex().encode() + b":agent") <= 600
    finally:
        a.close(), b.close()
    settings = replace(Settings(), shared=redis_server.url, shared_policy="demote", nvme_bytes=0)
    with pytest.raises(ConfigError, match="no NVMe tier"):
        check_shared(settings)
    assert check_shared(replace(settings, shared_policy="write-through")) == []
    warned = check_shared(replace(settings, shared="redis://127.0.0.1:1/0", shared_policy="write-through"))
    assert warned and "serving without the shared tier" in warned[0]


def test_tls_store_with_its_ca(tmp_path, geometry):
    """rediss:// with --shared-ca-file: a server with a certificate signed by a private CA."""
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    ca_key, ca, key, csr, cert = (tmp_path / n for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))
    run = lambda *a: subprocess.run(a, check=True, capture_output=True)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
        "-days", "1", "-subj", "/CN=kvtier-test-ca")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
        "-subj", "/CN=127.0.0.1")
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run("openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", "1", "-extfile", str(ext))
    with RedisServer(tmp_path / "tls", tls=(str(cert), str(key), str(ca))) as server:
        assert server.url.startswith("rediss://")
        store = SharedStore(SharedConfig(server.url, ca_file=str(ca)))
        payload = torch.randint(0, 256, (geometry.block_bytes,), dtype=torch.uint8)
        assert store.write_batch([(b"n" * 16, b"k" * 32, payload, "none")], b"f" * 16) == [None]
        dst = torch.empty_like(payload)
        assert store.read_batch([(b"n" * 16, b"k" * 32, dst)], b"f" * 16) == [(geometry.block_bytes, "none")]
        assert torch.equal(dst, payload)
        untrusting = SharedStore(SharedConfig(server.url))  # the system CAs do not know this one
        with pytest.raises(SharedUnavailable):
            untrusting.client.ping()
