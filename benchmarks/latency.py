"""Admin request latency, measured from a separate client process (as the CLI is) against the server
and against a do-nothing reference server in the same process (``EchoServer``): shared by the
benchmark on the in-process tier engine (``bench/admin.py``) and the one inside real vLLM
(``bench/vllm/admin.py``)."""
from __future__ import annotations

import json
import socket
import statistics
import threading
import time

__all__ = ["EchoServer", "latency_figures", "latency_in_subprocess"]


def _latency(sock: str, seconds: float, reference: str | None = None) -> dict[str, list[float]]:
    """Admin read requests in turn for ``seconds``; with ``reference``, each one is followed by the
    same request to the echo server there, so both see the same moments of load."""
    from kvtier.control.client import AdminClient

    clients = {"admin": AdminClient(sock)}
    if reference:
        clients["reference"] = AdminClient(reference)
    paths = ["/v1/status", "/v1/sessions", "/v1/tiers", "/metrics"]
    samples: dict[str, list[float]] = {name: [] for name in clients}
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        path = paths[i % len(paths)]
        for name, client in clients.items():
            start = time.perf_counter()
            client.request("GET", path, raw=path == "/metrics")
            samples[name].append(time.perf_counter() - start)
            time.sleep(0.001)
        i += 1
    for client in clients.values():
        client.close()
    return samples


def latency_in_subprocess(sock: str, seconds: float, reference: str | None = None) -> dict[str, list[float]]:
    """``_latency`` from a separate process, as the CLI and ``kvtier top`` are: the client must not
    compete with the engine for this process's GIL."""
    import subprocess
    import sys

    code = ("import json, sys; from benchmarks.latency import _latency; "
            "print(json.dumps(_latency(sys.argv[1], float(sys.argv[2]), sys.argv[3] or None)))")
    out = subprocess.run([sys.executable, "-c", code, sock, str(seconds), reference or ""], capture_output=True,
                         text=True, timeout=seconds + 120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


class EchoServer:
    """The reference for admin latency: the least an HTTP server thread in this process can do (read
    a request head, send a fixed answer), on the same kind of socket, under the same load. What the
    admin server adds on top of it is kvtier's own cost; the rest is the box (GIL, CPU scheduling)."""

    ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    def __init__(self, path: str):
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen()
        threading.Thread(target=self._accept, name="kvtier-bench-echo", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buffer += chunk
                buffer = buffer[buffer.index(b"\r\n\r\n") + 4:]
                conn.sendall(self.ANSWER)

    def close(self) -> None:
        self._sock.close()


def latency_figures(samples: dict[str, list[float]]) -> dict:
    admin, reference = samples["admin"], samples["reference"]
    return {"p99_ms_under_load": _p99(admin), "_p50_ms_under_load": statistics.median(admin) * 1e3,
            "_p99_ms_reference": _p99(reference), "_p50_ms_reference": statistics.median(reference) * 1e3,
            "_p99_ms_over_reference": _p99(admin) - _p99(reference), "_latency_samples": len(admin)}


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3
