"""``python -m benchmarks top``: what ``kvtier top`` costs, measured in a real terminal.

* ``cpu_percent_one_core``: CPU time of the ``kvtier top`` process (all its threads) over the
  measuring window, as a percentage of one core, at a 1 s refresh, watching a real admin server
  (an in-process tier engine) with 1,000 sessions whose state keeps changing.
* ``key_latency_ms``: median time from writing a key to the terminal (``?``, the help page) until
  the help text has arrived on the terminal, i.e. key-to-screen through Textual's real driver.

The dashboard runs in a child process on a pseudo-terminal (120x40), as a user would run it.
"""
from __future__ import annotations

import os
import select
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

__all__ = ["run_top_bench", "TOP_KEYS", "demo_admin", "PtyApp"]

TOP_KEYS = ("cpu_percent_one_core", "key_latency_ms")


def demo_admin(directory: Path, sessions: int, churn: bool = True):
    """A LocalAdmin over a small in-process tier engine holding ``sessions`` sessions; with
    ``churn`` a thread keeps storing into some of them (so every refresh has changes)."""
    from benchmarks.admin import _local_engine
    from kvtier.control.local import LocalAdmin
    from kvtier.plan.index import chain_block_hashes, namespace_of

    engine, fingerprint = _local_engine("bench-top", (2, 2, 32, 16), 64, max(64, 2 * sessions), directory)
    ns = namespace_of(fingerprint.digest)
    for n in range(sessions):
        tokens = list(range(n * 64, n * 64 + 32))
        engine.store(f"session-{n:04d}", ns, chain_block_hashes(tokens, 16), [0, 1], num_tokens=32, token_ids=tokens)
    admin = LocalAdmin(engine, directory / "admin.sock", snapshot_dir=directory / "snapshots").start()
    admin.stop_churn = threading.Event()

    def churn_loop() -> None:
        i = 0
        while not admin.stop_churn.wait(0.2):
            n = i % sessions
            tokens = list(range(n * 64, n * 64 + 32 + 16 * (i % 3)))
            with admin.lock:
                engine.manager.planner.record_session(f"session-{n:04d}", ns, chain_block_hashes(tokens, 16),
                                                      len(tokens), token_ids=tokens)
            i += 7

    if churn:
        threading.Thread(target=churn_loop, daemon=True).start()
    return admin, engine


class PtyApp:
    """``kvtier top`` in a child process on a pseudo-terminal; reads what it draws."""

    def __init__(self, args: list[str], size: tuple[int, int] = (120, 40), env: dict | None = None,
                 root_args: tuple[str, ...] = ()):
        import fcntl
        import pty
        import struct
        import subprocess
        import sys
        import termios

        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
        environ = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(size[0]), "LINES": str(size[1]),
                   **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli.main", *root_args, "top", *args], stdin=slave,
                                     stdout=slave, stderr=slave, env=environ, close_fds=True, start_new_session=True)
        os.close(slave)
        self.seen = b""

    def read_until(self, needle: bytes, timeout: float) -> bool:
        """Read the terminal until ``needle`` shows up (searching only what arrives from now on)."""
        start = len(self.seen)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.master], [], [], 0.01)
            if ready:
                try:
                    chunk = os.read(self.master, 1 << 16)
                except OSError:
                    return False
                self.seen += chunk
                if needle in self.seen[max(0, start - len(needle)):]:
                    return True
            elif self.proc.poll() is not None:
                return False
        return False

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.master], [], [], 0.05)
            if ready:
                try:
                    self.seen += os.read(self.master, 1 << 16)
                except OSError:
                    return
            self.seen = self.seen[-(1 << 20):]

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def close(self) -> int | None:
        try:
            self.send(b"q")
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - a hung child is killed below
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)
        return self.proc.returncode


def run_top_bench(quick: bool = False, progress: Callable[[str], None] = print, sessions: int = 1000) -> dict:
    import psutil

    seconds = 15.0 if quick else 60.0
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-top-") as tmp:
        admin, engine = demo_admin(Path(tmp), sessions)
        app = PtyApp(["--socket", str(Path(tmp) / "admin.sock"), "--interval", "1"])
        try:
            if not app.read_until(b"session-", 60):
                raise RuntimeError("kvtier top did not draw its sessions table:\n"
                                   + app.seen[-2000:].decode("utf-8", "replace"))
            app.drain(3.0)  # startup (imports, first layout) is not the steady state
            proc = psutil.Process(app.proc.pid)
            progress(f"CPU of kvtier top at a 1 s refresh with {sessions} sessions, for {seconds:.0f} s")
            before, start = proc.cpu_times(), time.monotonic()
            app.drain(seconds)
            after, elapsed = proc.cpu_times(), time.monotonic() - start
            cpu = (after.user + after.system - before.user - before.system) / elapsed * 100
            progress("key-to-screen latency: '?' (help) then escape, 20 times")
            latencies = []
            for _ in range(10 if quick else 20):
                app.drain(0.3)
                sent = time.perf_counter()
                app.send(b"?")
                if not app.read_until(b"Bars: HBM", 10):
                    raise RuntimeError("the help page did not appear")
                latencies.append((time.perf_counter() - sent) * 1e3)
                app.send(b"\x1b")
                app.drain(0.3)
        finally:
            code = app.close()
            admin.stop_churn.set()
            admin.stop()
            engine.close(write_back=False)
    return {"cpu_percent_one_core": cpu, "key_latency_ms": statistics.median(latencies),
            "_key_latency_p95_ms": sorted(latencies)[int(0.95 * (len(latencies) - 1))],
            "_sessions": sessions, "_seconds": seconds, "_terminal": "pty 120x40", "_exit_code": code}
