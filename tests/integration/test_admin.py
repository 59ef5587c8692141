"""The admin API and the session CLI: CliRunner against a real server on a real Unix socket, backed by
a real TierEngine (DRAM arena, NVMe files) whose jobs run on an engine thread, as in vLLM."""
from __future__ import annotations

import json
import os
import random
import socket
import stat
import threading

import pytest
from support.engine import make_engine
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.control.client import AdminClient
from kvtier.control.local import LocalAdmin
from kvtier.control.wire import (
    MAX_BODY,
    MAX_HEAD,
    Head,
    RequestError,
    body_length,
    check_auth,
    parse_head,
    split_head,
)
from kvtier.plan.index import chain_block_hashes, namespace_of

runner = CliRunner()


def keys_of(seed: int, blocks: int) -> list[bytes]:
    return chain_block_hashes(list(range(seed * 10_000, seed * 10_000 + blocks * 16)), 16)


@pytest.fixture
def server(fingerprint, hbm, tmp_path):
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=16, nvme_blocks=64)
    ns = namespace_of(fingerprint.digest)
    for session, seed, blocks, tokens, hbm_blocks in (("agent-1", 1, 4, 64, [0, 1, 2, 3]), ("agent-2", 2, 2, 40, [4,
                                                                                                                  5])):
        ids = list(range(seed * 10_000, seed * 10_000 + tokens))  # as vLLM's scheduler half records them
        engine.manager.planner.record_session(session, ns, keys_of(seed, blocks), tokens, token_ids=ids)
        engine.store(session, ns, keys_of(seed, blocks), hbm_blocks, num_tokens=tokens)
    sock = tmp_path / "run" / "kvtier.sock"
    admin = LocalAdmin(engine, sock, snapshot_dir=tmp_path / "snapshots").start()
    admin.sock = str(sock)
    admin.ns = ns
    yield admin
    admin.stop()
    engine.close(write_back=False)


def cli(admin, *args):
    result = runner.invoke(app, [*args, "--socket", admin.sock] if args[0] != "snapshot" else
                           [args[0], *args[1:], "--socket", admin.sock])
    return result


def test_socket_is_private(server):
    mode = os.stat(server.sock).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(server.sock)).st_mode) == 0o700


def test_status_sessions_inspect(server):
    result = cli(server, "status", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["model"] == "test-model" and doc["tiers"]["dram"]["blocks"] == 6
    assert doc["tiers"]["dram"]["tokens_per_gib"] > 0 and doc["sessions"]["warm"] == 2
    table = cli(server, "status")
    assert table.exit_code == 0 and "tokens/GiB" in table.output
    listed = json.loads(cli(server, "sessions", "--json", "--sort", "tokens").output)
    assert [s["session_id"] for s in listed["sessions"]] == ["agent-1", "agent-2"]
    assert json.loads(cli(server, "sessions", "--json", "--state", "cold").output)["sessions"] == []
    one = json.loads(cli(server, "inspect", "agent-1", "--json").output)
    assert one["blocks_dram"] == 4 and one["tokens"] == 64 and one["codec_dram"] == "none"
    assert "agent-1" in cli(server, "inspect", "agent-1").output


def test_pin_evict_snapshot_restore_through_the_cli(server, tmp_path):
    assert cli(server, "pin", "agent-1", "--tier", "nvme").exit_code == 0
    assert json.loads(cli(server, "inspect", "agent-1", "--json").output)["pinned"] == "nvme"
    assert cli(server, "unpin", "agent-1").exit_code == 0
    result = cli(server, "evict", "agent-1", "--to", "nvme")
    assert result.exit_code == 0, result.output
    info = json.loads(cli(server, "inspect", "agent-1", "--json").output)
    assert info["blocks_nvme"] == 4 and info["blocks_dram"] == 0 and info["state"] == "cold"
    assert cli(server, "evict", "agent-1", "--to", "dram").exit_code == 0
    assert json.loads(cli(server, "inspect", "agent-1", "--json").output)["blocks_dram"] == 4
    snap = cli(server, "snapshot", "agent-1", "--json")
    assert snap.exit_code == 0, snap.output
    job = json.loads(snap.output)
    assert job["state"] == "done" and job["path"].endswith("agent-1.kvsnap")
    out = tmp_path / "elsewhere.kvsnap"
    assert cli(server, "snapshot", "agent-2", "--out", str(out)).exit_code == 0 and out.is_file()
    assert runner.invoke(app, ["snapshot", "verify", job["path"]]).exit_code == 0  # offline, no server
    # drop it everywhere, then restore it from the file
    assert cli(server, "evict", "agent-1", "--to", "drop", "--yes").exit_code == 0
    assert server.engine.manager.table.lookup(server.ns, keys_of(1, 4)) == []
    restored = cli(server, "restore", job["path"], "--tier", "nvme")
    assert restored.exit_code == 0, restored.output
    assert len(server.engine.manager.table.lookup(server.ns, keys_of(1, 4))) == 4
    jobs = json.loads(cli(server, "jobs", "--json").output)["jobs"]
    assert {j["kind"] for j in jobs} >= {"pin", "evict", "snapshot", "restore"}
    assert all(j["state"] == "done" for j in jobs)


def test_no_wait_returns_a_job_id_and_busy_sessions_refuse_a_second_write(server):
    server.paused.set()  # the engine thread holds jobs: the snapshot stays in flight
    result = cli(server, "snapshot", "agent-1", "--no-wait", "--json")
    job = json.loads(result.output)
    assert job["state"] in ("queued", "running")
    busy = cli(server, "evict", "agent-1", "--to", "nvme")
    assert busy.exit_code == 1 and "in progress" in busy.output and f"kvtier jobs {job['id']}" in busy.output
    server.paused.clear()
    server.drain()
    assert json.loads(cli(server, "jobs", str(job["id"]), "--json").output)["state"] == "done"
    assert cli(server, "evict", "agent-1", "--to", "nvme").exit_code == 0


@pytest.mark.parametrize("args, code, text", [
    (("inspect", "nobody"), 4, "nobody"),
    (("inspect", "../../etc/passwd"), 2, "invalid session id"),
    (("pin", "agent-1", "--tier", "hbm"), 2, "tier must be one of"),
    (("evict", "agent-1", "--to", "tape"), 2, "to must be one of"),
    (("snapshot", "nobody"), 4, "nobody"),
    (("restore", "/does/not/exist.kvsnap"), 4, "does not exist"),
    (("jobs", "999999"), 4, "no job"),
    (("sessions", "--state", "lukewarm"), 2, "unknown state"),
])
def test_bad_input_is_a_clear_error_and_changes_nothing(server, args, code, text):
    before = server.engine.manager.views.stats()
    result = cli(server, *args)
    assert result.exit_code == code, result.output
    assert text in result.output and "hint:" in result.output and "Traceback" not in result.output
    after = server.engine.manager.views.stats()
    assert before["dram"] == after["dram"] and before["nvme"] == after["nvme"]


def raw(sock_path: str, request: bytes) -> tuple[int, dict]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(sock_path)
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int([line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")][0])
        while len(body) < length:
            body += s.recv(65536)
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("request_bytes, status", [
    (b"POST /v1/sessions/agent-1/pin HTTP/1.1\r\nContent-Length: 9\r\n\r\n{not json", 400),
    (b"POST /v1/sessions/agent-1/pin HTTP/1.1\r\nContent-Length: 2\r\n\r\n[]", 400),
    (b"POST /v1/sessions/agent-1/pin HTTP/1.1\r\nContent-Length: 15\r\n\r\n{\"tier\": \"x\"}  ", 400),
    (b"POST /v1/sessions/agent-1/pin HTTP/1.1\r\nContent-Length: 13\r\n\r\n{\"rm\": \"-rf\"}", 400),
    (b"POST /v1/sessions/agent-1/pin HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n{}", 413),
    (b"POST /v1/sessions/agent-1/snapshot HTTP/1.1\r\nContent-Length: 26\r\n\r\n{\"path\": \"../../etc/x.kv\"}", 400),
    (b"GET /v1/sessions/..%2F..%2Fetc HTTP/1.1\r\n\r\n", 400),
    (b"GET /v1/nothing HTTP/1.1\r\n\r\n", 404),
    (b"DELETE /v1/status HTTP/1.1\r\n\r\n", 405),
    (b"GET /v1/sessions?limit=abc HTTP/1.1\r\n\r\n", 400),
])
def test_malformed_requests_get_json_errors(server, request_bytes, status):
    got, body = raw(server.sock, request_bytes)
    assert got == status and body["error"]
    assert AdminClient(server.sock).get("/v1/status")["tiers"]["dram"]["blocks"] == 6  # still serving


@pytest.mark.parametrize("request_bytes", [
    "POST /v1/flush HTTP/1.1\r\nContent-Length: \u00b2\r\n\r\n{}".encode("utf-8"),  # "²".isdigit() is True
    "POST /v1/flush HTTP/1.1\r\nContent-Length: \u0662\r\n\r\n{}".encode("utf-8"),  # an Arabic-Indic 2
    b"POST /v1/flush HTTP/1.1\r\nContent-Length: +2\r\n\r\n{}",
    b"POST /v1/flush HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
    b"GET /v1/status HTTP/1.1\r\nX-A: b\r\n folded: continuation\r\n\r\n",  # obsolete line folding
    b"GET /v1/status HTTP/1.1\r\nX-A: b\r\n\tfolded\r\n\r\n",
    b"GET /v1/status HTTP/1.1\r\nBad Name: x\r\n\r\n",
    b"GET /v1/status HTTP/1.1\r\nX-A: \x01ctl\r\n\r\n",
    b"G(T /v1/status HTTP/1.1\r\n\r\n",
    b"GET /v1/st\xe9tus HTTP/1.1\r\n\r\n",
])
def test_the_parser_is_as_strict_as_h11(server, request_bytes):
    """Each of these is refused by h11 (a well-kept HTTP/1.1 parser); the admin server refuses it too,
    with a JSON 400, and goes on serving."""
    import h11

    conn = h11.Connection(h11.SERVER)
    conn.receive_data(request_bytes)
    with pytest.raises(h11.RemoteProtocolError):
        while conn.next_event() not in (h11.NEED_DATA, h11.PAUSED):
            pass
    got, body = raw(server.sock, request_bytes)
    assert got == 400 and body["error"], body
    assert AdminClient(server.sock).get("/v1/status")["tiers"]["dram"]["blocks"] == 6


def test_connections_are_capped_and_idle_ones_cost_no_thread(server):
    from kvtier.control.server import MAX_CONNECTIONS

    threads = threading.active_count()
    idle = []
    try:
        for _ in range(MAX_CONNECTIONS):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(server.sock)
            idle.append(s)
        assert server.server.wait_connections(MAX_CONNECTIONS)  # every one accepted and holding a slot
        refused = []
        for _ in range(200):  # beyond the cap: a 503 at once, and no new thread
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(server.sock)
            refused.append(s.recv(200).split(b"\r\n", 1)[0])
            s.close()
        assert set(refused) == {b"HTTP/1.1 503 Service Unavailable"}
        assert threading.active_count() <= threads + MAX_CONNECTIONS
    finally:
        for s in idle:
            s.close()
    assert server.server.wait_connections(0)  # the slots come back as the idle connections close
    assert AdminClient(server.sock).get("/v1/status")["tiers"]["dram"]["blocks"] == 6


# ---- the head parser alone: bytes in, a Head or a RequestError out, no socket ----------------------
@pytest.mark.parametrize("data, head", [
    (b"GET /v1/status HTTP/1.1", Head("GET", "/v1/status", "HTTP/1.1", {}, True)),
    (b"\r\n\r\nGET /v1/tiers HTTP/1.1\r\nHost: x", Head("GET", "/v1/tiers", "HTTP/1.1", {"host": "x"}, True)),
    (b"POST /v1/flush HTTP/1.1\r\nContent-LENGTH: \t2 \r\nConnection: Close",
     Head("POST", "/v1/flush", "HTTP/1.1", {"content-length": "2", "connection": "Close"}, False)),
    (b"GET /metrics HTTP/1.0", Head("GET", "/metrics", "HTTP/1.0", {}, False)),
    (b"GET /metrics HTTP/1.0\r\nConnection: keep-alive",
     Head("GET", "/metrics", "HTTP/1.0", {"connection": "keep-alive"}, True)),
    (b"GET /a?b=%2F HTTP/1.1\r\nX-A: 1\r\nx-a: 2", Head("GET", "/a?b=%2F", "HTTP/1.1", {"x-a": "2"}, True)),
])
def test_parse_head_reads_the_request_line_and_fields(data, head):
    assert parse_head(data) == head


@pytest.mark.parametrize("data, status, text", [
    (b"", 400, "malformed request line"),
    (b"GARBAGE", 400, "malformed request line"),
    (b"GET  /v1/status HTTP/1.1", 400, "malformed request line"),
    (b"GET v1/status HTTP/1.1", 400, "malformed request line"),
    (b"GET /v1/status HTTP/2.0", 505, "unsupported protocol"),
    (b"GET /v1/status HTTP/1.1\r\nno-colon-here", 400, "malformed header line"),
    (b"GET /v1/status HTTP/1.1\r\nX-A: b\r\n folded: continuation", 400, "malformed header line"),
    (b"GET /v1/status HTTP/1.1\r\nX-A: b\nX-B: c", 400, "malformed header line"),  # a bare LF is no line end
    (b"GET /v1/status HTTP/1.1\r\nHost: a\r\nhost: b", 400, "duplicate host header"),
    (b"GET /v1/status HTTP/1.1\r\nX-Big: " + b"a" * MAX_HEAD, 431, "too large"),
])
def test_parse_head_refuses_with_the_status_to_answer(data, status, text):
    with pytest.raises(RequestError) as err:
        parse_head(data)
    assert err.value.status == status and text in err.value.message


def test_framing_auth_and_length_decisions_from_the_head_alone():
    assert split_head(b"GET / HTTP/1.1\r\nHost: x\r\n") is None  # more is needed
    assert split_head(b"GET / HTTP/1.1\r\n\r\nGET /next") == (b"GET / HTTP/1.1", b"GET /next")
    with pytest.raises(RequestError) as err:
        split_head(b"a" * (MAX_HEAD + 1))
    assert err.value.status == 431
    head = parse_head(b"POST /v1/flush HTTP/1.1\r\nAuthorization: Bearer t0k\r\nContent-Length: 12")
    assert body_length(head) == 12 and body_length(parse_head(b"GET / HTTP/1.1")) is None
    check_auth(head, b"Bearer t0k")
    check_auth(head, None)  # the Unix socket: no token
    for expected in (b"Bearer other", b"Bearer t0k2"):
        with pytest.raises(RequestError) as err:
            check_auth(head, expected)
        assert err.value.status == 401
    for field, status in ((b"Transfer-Encoding: chunked", 411), (b"Content-Length: +2", 400),
                          (b"Content-Length: \xb2", 400), (b"Content-Length: %d" % (MAX_BODY + 1), 413)):
        with pytest.raises(RequestError) as err:
            body_length(parse_head(b"POST /v1/flush HTTP/1.1\r\n" + field))
        assert err.value.status == status


_FUZZ_SEEDS = [
    b"GET /v1/status HTTP/1.1\r\nHost: x",
    b"POST /v1/sessions/agent-1/pin HTTP/1.1\r\nContent-Length: 16\r\nExpect: 100-continue",
    b"GET /v1/tiers HTTP/1.0\r\nConnection: keep-alive\r\nAuthorization: Bearer t",
    b"\r\nPOST /v1/flush HTTP/1.1\r\nTransfer-Encoding: chunked\r\nX-A: \tb ",
]
_FUZZ_BYTES = b"\r\n \t:/\x00\x01\x7f\x80\xff\xb2HTPGE1.09-+aZ%?"


def _mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        pick = rng.randrange(8)
        at = rng.randint(0, len(out))
        if pick == 0 and out:  # flip a byte
            out[min(at, len(out) - 1)] = rng.randrange(256)
        elif pick == 1:  # insert a few interesting bytes
            out[at:at] = bytes(rng.choice(_FUZZ_BYTES) for _ in range(rng.randint(1, 3)))
        elif pick == 2:  # cut a slice
            del out[at:at + rng.randint(1, 12)]
        elif pick == 3:  # a line break, a fold or a blank line where none belongs
            out[at:at] = rng.choice([b"\r\n", b"\n", b"\r", b"\r\n ", b"\r\n\t", b"\r\n\r\n"])
        elif pick == 4:  # a duplicated or extra header
            out += rng.choice([b"\r\nContent-Length: 2", b"\r\nHost: y", b"\r\nX-A: b", b"\r\n: empty"])
        elif pick == 5:  # another protocol version
            out = bytearray(bytes(out).replace(b"HTTP/1.", rng.choice([b"HTTP/2.", b"HTTP/1.", b"http/1.", b"HTTP/"])))
        elif pick == 6:  # oversize
            out += b"\r\nX-Pad: " + b"p" * rng.choice([MAX_HEAD - len(out) - 9, MAX_HEAD, 2 * MAX_HEAD])
        else:  # random bytes, start to end
            out = bytearray(rng.randbytes(rng.randint(0, 64)))
    return bytes(out)


def test_parse_head_fuzz_gives_a_head_or_a_request_error_and_nothing_else():
    rng = random.Random(0x6B76)
    refused: dict[int, int] = {}
    accepted = 0
    for _ in range(4000):
        data = _mutate(rng, rng.choice(_FUZZ_SEEDS))
        try:
            head = parse_head(data)
        except RequestError as exc:  # anything else escapes and fails the test
            assert exc.status in (400, 431, 505) and exc.message
            refused[exc.status] = refused.get(exc.status, 0) + 1
            continue
        accepted += 1
        assert isinstance(head, Head) and len(data) <= MAX_HEAD
        assert head.target.startswith("/") and head.version in ("HTTP/1.1", "HTTP/1.0")
        assert all(k == k.lower() and ":" not in k for k in head.headers)
        assert not any(c in v for v in head.headers.values() for c in "\r\n\x00")
        for decide in (lambda: body_length(head), lambda: check_auth(head, b"Bearer t")):
            try:
                size = decide()
            except RequestError as exc:
                assert exc.status in (400, 401, 411, 413)
            else:
                assert size is None or 0 <= size <= MAX_BODY
        try:
            framed = split_head(data + b"\r\n\r\n")
        except RequestError as exc:
            assert exc.status == 431
        else:
            assert framed is not None
    assert accepted > 100 and set(refused) == {400, 431, 505}, (accepted, refused)


def exchange(sock_path: str, data: bytes, answers: int) -> list[tuple[int, bytes, bytes]]:
    """Send raw bytes on one connection; read ``answers`` responses (status, head, body)."""
    out = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(sock_path)
        s.sendall(data)
        buf = b""
        for _ in range(answers):
            while b"\r\n\r\n" not in buf:
                chunk = s.recv(65536)
                assert chunk, f"connection closed after {len(out)} answers"
                buf += chunk
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = int([line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")][0])
            while len(buf) < length:
                buf += s.recv(65536)
            out.append((int(head.split()[1]), head, buf[:length]))
            buf = buf[length:]
        s.settimeout(1)
        try:
            trailing = s.recv(1)
        except socket.timeout:
            trailing = None  # still open
    out.append(trailing)
    return out


def test_keep_alive_and_pipelined_requests_each_get_their_answer(server):
    two = b"GET /v1/tiers HTTP/1.1\r\n\r\nGET /v1/sessions/agent-2 HTTP/1.1\r\nHost: x\r\n\r\n"
    first, second, trailing = exchange(server.sock, two, 2)
    assert first[0] == 200 and "dram" in json.loads(first[2])
    assert second[0] == 200 and json.loads(second[2])["session_id"] == "agent-2"
    assert trailing is None  # HTTP/1.1: the connection stays open for more
    body = b'{"tier": "nvme"}'
    post = b"POST /v1/sessions/agent-2/pin HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    answer, trailing = exchange(server.sock, post + b"GET /v1/jobs HTTP/1.1\r\nConnection: close\r\n\r\n", 2)[1:]
    assert answer[0] == 200 and json.loads(answer[2])["jobs"][0]["kind"] == "pin"
    assert trailing == b""  # Connection: close is honoured
    assert exchange(server.sock, b"GET /v1/tiers HTTP/1.0\r\n\r\n", 1)[1] == b""  # 1.0 closes by default


@pytest.mark.parametrize("request_bytes, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /v1/status HTTP/2.0\r\n\r\n", 505),
    (b"GET /v1/status HTTP/1.1\r\nno-colon-here\r\n\r\n", 400),
    (b"GET /v1/status HTTP/1.1\r\n folded: header\r\n\r\n", 400),
    (b"POST /v1/sessions/agent-1/pin HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 411),
    (b"POST /v1/sessions/agent-1/pin HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400),
    (b"GET /v1/status HTTP/1.1\r\nX-Big: " + b"a" * (20 << 10) + b"\r\n\r\n", 431),
])
def test_protocol_errors_answer_and_close(server, request_bytes, status):
    answer, trailing = exchange(server.sock, request_bytes, 1)
    assert answer[0] == status and json.loads(answer[2])["error"]
    assert b"Connection: close" in answer[1] and trailing == b""
    assert AdminClient(server.sock).get("/v1/status")["tiers"]["dram"]["blocks"] == 6


def test_a_body_shorter_than_its_length_is_refused_when_the_client_stops_sending(server):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(server.sock)
        s.sendall(b"POST /v1/sessions/agent-1/pin HTTP/1.1\r\nContent-Length: 40\r\n\r\n{}")
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 400") and b"shorter" in data
    assert AdminClient(server.sock).get("/v1/sessions/agent-1")["pinned"] is None


def test_expect_100_continue(server):
    body = b'{"to": "nvme"}'
    head = b"POST /v1/sessions/agent-2/evict HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(server.sock)
        s.sendall(head)
        assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(body)
        assert s.recv(65536).startswith(b"HTTP/1.1 202")


def test_metrics_in_prometheus_text(server):
    cli(server, "evict", "agent-2", "--to", "nvme")
    text = AdminClient(server.sock).request("GET", "/metrics", raw=True)
    assert 'kvtier_tier_bytes{tier="dram"}' in text and 'kvtier_sessions{state="warm"} 1.0' in text
    assert 'kvtier_job_seconds_count{kind="evict"} 1.0' in text
    assert "kvtier_link_bytes" in text


def test_no_server_is_exit_code_3(tmp_path):
    result = runner.invoke(app, ["status", "--socket", str(tmp_path / "none.sock")])
    assert result.exit_code == 3 and "kvtier serve" in result.output


def test_tcp_needs_the_token(fingerprint, hbm, tmp_path):
    from kvtier.errors import KvtierError, UsageError

    engine = make_engine(fingerprint, hbm, tmp_path, nvme_blocks=0)
    with pytest.raises(UsageError):
        LocalAdmin(engine, tmp_path / "a.sock", tcp=("0.0.0.0", 0), token="t")  # loopback only
    with pytest.raises(UsageError):
        LocalAdmin(engine, tmp_path / "a.sock", tcp=("127.0.0.1", 0))  # a token is required
    admin = LocalAdmin(engine, tmp_path / "b.sock", tcp=("127.0.0.1", 0), token="s3cret-token").start()
    try:
        url = f"http://127.0.0.1:{admin.server.tcp_port}"
        with pytest.raises(KvtierError) as err:
            AdminClient(url=url).get("/v1/status")
        assert "token" in str(err.value)
        with pytest.raises(KvtierError):
            AdminClient(url=url, token="wrong").get("/v1/status")
        # the token is checked before the body is read: a stranger's huge body is never waited for
        with socket.create_connection(("127.0.0.1", admin.server.tcp_port), timeout=5) as raw_tcp:
            raw_tcp.sendall(b"POST /v1/flush HTTP/1.1\r\nAuthorization: Bearer nope\r\n"
                            b"Content-Length: 60000\r\n\r\n")
            assert raw_tcp.recv(100).startswith(b"HTTP/1.1 401 ")
        assert AdminClient(url=url, token="s3cret-token").get("/v1/status")["model"] == "test-model"
    finally:
        admin.stop()


def test_a_second_server_on_a_live_socket_is_refused(server, fingerprint, hbm, tmp_path):
    from kvtier.errors import UsageError

    other = make_engine(fingerprint, hbm, tmp_path / "other", nvme_blocks=0)
    with pytest.raises(UsageError) as err:
        LocalAdmin(other, server.sock).start()
    assert "already listening" in err.value.message


def test_concurrent_clients(server):
    errors = []

    def reader():
        client = AdminClient(server.sock)
        try:
            for _ in range(50):
                client.get("/v1/sessions")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_fuzz_finds_no_crash_and_no_accepted_invalid_request(server, tmp_path):
    from benchmarks.admin import fuzz

    counts = fuzz(server.sock, 80, seed=1, snapshot_dir=tmp_path / "snapshots")
    assert counts["requests"] == 80
    assert counts["crashes"] == 0 and counts["accepted_invalid"] == 0
    assert AdminClient(server.sock).get("/v1/status")["model"] == "test-model"


def test_fuzz_oracle_flags_what_a_lax_server_would_accept(server, monkeypatch):
    """The fuzz harness can fail: a server that accepted unknown fields would be counted."""
    from benchmarks.admin import _send, is_valid_request
    from kvtier.control import server as srv

    body = b'{"tier": "dram", "extra": 1}'
    request = (b"POST /v1/sessions/agent-2/pin HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
    assert not is_valid_request("POST", "/v1/sessions/agent-2/pin", body)
    assert _send(server.sock, request) == 400  # the real server refuses it
    monkeypatch.setitem(srv._BODY_FIELDS, "pin", {"tier", "extra"})  # a lax server
    assert _send(server.sock, request) == 202  # ...accepts it: the oracle above would count it
    assert is_valid_request("POST", "/v1/sessions/agent-2/pin", b'{"tier": "nvme"}')
    assert not is_valid_request("POST", "/v1/sessions/agent-2/snapshot", b'{"path": "../x.kvsnap"}')
    assert not is_valid_request("GET", "/v1/sessions/../etc", None)


def test_admin_latency_bench_measures_admin_and_reference():
    """The latency half of `python -m benchmarks admin` (in-process engine): both series, every figure."""
    from benchmarks.admin import run_local_load_latency

    out = run_local_load_latency(1.0, lambda _msg: None)
    assert out["_latency_samples"] > 20
    assert out["p99_ms_under_load"] > 0 and out["_p99_ms_reference"] > 0
    assert out["_p50_ms_under_load"] <= out["p99_ms_under_load"]
    assert out["_p99_ms_over_reference"] == out["p99_ms_under_load"] - out["_p99_ms_reference"]


def test_one_client_shared_by_threads(server):
    """`kvtier top` polls and acts through one client from two threads."""
    client, errors = AdminClient(server.sock), []

    def reader():
        try:
            for _ in range(40):
                assert client.get("/v1/sessions")["total"] == 2
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_flush_through_the_cli_and_the_dirty_figures(server):
    # 1. six blocks are in DRAM only: status, /metrics and the table say so
    doc = json.loads(cli(server, "status", "--json").output)
    assert doc["dirty"]["dirty_blocks"] == 6 and doc["dirty"]["dirty_bytes"] > 0
    assert doc["catalog"]["path"].endswith(".sqlite")
    assert "not yet on NVMe: " in cli(server, "status").output
    metrics = AdminClient(server.sock).request("GET", "/metrics", raw=True)
    assert "kvtier_dirty_blocks 6.0" in metrics
    # 2. kvtier flush writes them, keeps them in DRAM, and says how much moved
    result = cli(server, "flush")
    assert result.exit_code == 0 and "flush: done" in result.output, result.output
    doc = json.loads(cli(server, "status", "--json").output)
    assert doc["dirty"] == {"dirty_blocks": 0, "dirty_bytes": 0, "dirty_age_s": 0.0, "storing_blocks": 0}
    assert doc["tiers"]["dram"]["blocks"] == 6 and doc["tiers"]["nvme"]["blocks"] == 6
    assert "kvtier_durable_blocks_total{how=\"flush\"} 6.0" in \
        AdminClient(server.sock).request("GET", "/metrics", raw=True)
    # 3. nothing left: done at once; a session that does not exist: not found, with a hint
    assert json.loads(cli(server, "flush", "--json").output)["state"] == "done"
    missing = cli(server, "flush", "--session", "nobody")
    assert missing.exit_code == 4 and "hint:" in missing.output


def test_a_pin_is_in_the_catalog_when_the_command_returns(server):
    import sqlite3

    from kvtier.persist.catalog import _META

    assert cli(server, "pin", "agent-2", "--tier", "nvme").exit_code == 0
    # read the catalog file as a restart would, while the server still runs
    with sqlite3.connect(f"file:{server.engine.catalog.path}?mode=ro", uri=True) as db:
        meta = db.execute("SELECT meta FROM sessions WHERE session_id = 'agent-2'").fetchone()[0]
    assert _META.unpack_from(meta)[2] == 2  # pinned to Tier.NVME


def test_the_cli_reaches_the_tcp_listener_with_its_token(fingerprint, hbm, tmp_path, monkeypatch):
    """KVTIER_ADMIN_URL + KVTIER_ADMIN_TOKEN (or KVTIER_ADMIN_TOKEN_FILE): the CLI talks to the loopback
    TCP listener; no token or a readable token file is refused with a hint."""
    engine = make_engine(fingerprint, hbm, tmp_path, nvme_blocks=0)
    token = "t0ken-" + "x" * 20
    admin = LocalAdmin(engine, tmp_path / "c.sock", tcp=("127.0.0.1", 0), token=token).start()
    for key in ("KVTIER_ADMIN_SOCKET", "KVTIER_INSTANCE", "KVTIER_ADMIN_TOKEN", "KVTIER_ADMIN_TOKEN_FILE"):
        monkeypatch.delenv(key, raising=False)
    try:
        url = f"http://127.0.0.1:{admin.server.tcp_port}"
        ok = runner.invoke(app, ["status", "--json"], env={"KVTIER_ADMIN_URL": url, "KVTIER_ADMIN_TOKEN": token})
        assert ok.exit_code == 0, ok.output
        assert json.loads(ok.output)["model"] == "test-model"
        missing = runner.invoke(app, ["status"], env={"KVTIER_ADMIN_URL": url})
        assert missing.exit_code == 2 and "bearer token" in missing.stderr
        token_file = tmp_path / "token"
        token_file.write_text(token)
        token_file.chmod(0o644)
        loose = runner.invoke(app, ["status"], env={"KVTIER_ADMIN_URL": url,
                                                    "KVTIER_ADMIN_TOKEN_FILE": str(token_file)})
        assert loose.exit_code == 2 and "chmod 600" in loose.stderr
        token_file.chmod(0o600)
        fine = runner.invoke(app, ["sessions", "--json"],
                             env={"KVTIER_ADMIN_URL": url, "KVTIER_ADMIN_TOKEN_FILE": str(token_file)})
        assert fine.exit_code == 0, fine.output
    finally:
        admin.stop()
        engine.close(write_back=False)


def test_status_until_clean_answers_when_the_last_dirty_block_is_written(server):
    """A caller waits on the engine's results (``until=clean``), not by polling: held while the
    flush job is queued, it answers once that job's result is applied, with nothing dirty."""
    client = AdminClient(server.sock, timeout=60)
    try:
        now = client.get("/v1/status?until=clean&wait_s=0")  # a zero wait answers as things are
        assert now["dirty"]["dirty_blocks"] == 6
        server.paused.set()  # the flush job stays queued until released
        job = client.post("/v1/flush", {})
        answered: list[dict] = []
        waiter = threading.Thread(target=lambda: answered.append(
            AdminClient(server.sock, timeout=60).get("/v1/status?until=clean&wait_s=60")))
        waiter.start()
        assert server.ops.wait_for(lambda: server.ops.waiting == 2, 10)  # the long poll waits (and so does this)
        assert not answered and client.get(f"/v1/jobs/{job['id']}")["state"] == "queued"
        server.paused.clear()
        waiter.join(timeout=60)
        assert answered and answered[0]["dirty"]["dirty_blocks"] == 0
        assert client.get(f"/v1/jobs/{job['id']}")["state"] == "done"
    finally:
        server.paused.clear()
        client.close()


def test_status_until_clean_waits_for_a_store_still_on_its_way_into_dram(server):
    """A store runs behind the step: its blocks are not dirty yet, but a crash would lose them too,
    so until=clean waits for them to land and be written behind (a bench measured a "clean" server
    that had 16 blocks still on their way)."""
    client = AdminClient(server.sock, timeout=60)
    try:
        with server.lock:
            job = server.engine.manager.prepare_store("agent-3", server.ns, keys_of(3, 2), [6, 7])
        assert job is not None and len(job.moves) == 2
        now = client.get("/v1/status?until=clean&wait_s=0")
        assert now["dirty"]["storing_blocks"] == 2
        with server.lock:
            server.engine.write_behind(0)  # the others are written: only the store in flight is left
        now = client.get("/v1/status")["dirty"]
        assert now["dirty_blocks"] == 0 and now["storing_blocks"] == 2, now
        answered: list[dict] = []
        waiter = threading.Thread(target=lambda: answered.append(
            AdminClient(server.sock, timeout=60).get("/v1/status?until=clean&wait_s=60")))
        waiter.start()
        assert server.ops.wait_for(lambda: server.ops.waiting == 2, 10)  # it waits (and so do we): 2 on their way
        with server.lock:
            server.ops.applied()  # a result that changes nothing the waiter waits for: it still waits
            assert server.ops.waiting == 1 and not answered
            server.engine.execute(job)  # the store lands: two dirty blocks
            server.engine.write_behind(0)
            server.ops.applied()
        waiter.join(timeout=60)
        assert answered and answered[0]["dirty"]["dirty_blocks"] == 0 and answered[0]["dirty"]["storing_blocks"] == 0
    finally:
        client.close()


@pytest.mark.parametrize("query, hint", [("until=soon", "until=clean"), ("until=clean&wait_s=x", "wait_s=30"),
                                         ("until=clean&wait_s=9999", "wait_s=30")])
def test_status_until_rejects_what_it_cannot_wait_for(server, query, hint):
    from kvtier.errors import KvtierError

    client = AdminClient(server.sock, timeout=10)
    try:
        with pytest.raises(KvtierError) as err:
            client.get(f"/v1/status?{query}")
        assert hint in (err.value.hint or "")
    finally:
        client.close()
