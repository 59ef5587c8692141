"""Running vLLM's server as a child: the ``Supervisor`` state machine (starting, running, ready,
flushing, stopping, killed, then stopped or exited) and the process-facing parts it is given
(spawning into a new process group, signalling and reaping the group, polling ``/health``).

The state machine takes those parts and a clock as arguments, so a test walks its transitions
with fakes; :func:`run_server` wires in the real ones, the signal handlers and the health poller.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

__all__ = ["GRACE_S", "Supervisor", "run_server"]

GRACE_S = 30.0
STARTING, RUNNING, READY, FLUSHING, STOPPING, KILLED, STOPPED, EXITED = (
    "starting", "running", "ready", "flushing", "stopping", "killed", "stopped", "exited")

Say = Callable[[str], None]


class Child(Protocol):
    """What the supervisor needs of the child process (``subprocess.Popen`` has it)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Running(Protocol):
    """A started background action (``threading.Thread`` has it)."""

    def is_alive(self) -> bool: ...


def _in_thread(target: Callable[[], None]) -> Running:
    thread = threading.Thread(target=target, name="kvtier-flush-on-stop", daemon=True)
    thread.start()
    return thread


class Supervisor:
    """One child server from start to exit. ``on_signal`` is the first/second SIGINT/SIGTERM, ``ready``
    the first ``/health`` answer, ``tick`` one look at the clock while the child runs, ``finish`` its
    exit; ``run`` loops ``tick`` until the child exits.

    ``before_stop`` (the flush of dirty KV) runs on the first signal, before the child is told to
    stop, for at most ``stop_timeout_s``; the child still alive ``grace_s`` after SIGTERM is killed.
    """

    def __init__(self, spawn: Callable[[], Child], url: str, *, say: Say = print, grace_s: float = GRACE_S,
                 before_stop: Callable[[], None] | None = None, stop_timeout_s: float = 60.0,
                 signal_group: Callable[[int, int], bool] | None = None,
                 run_in_thread: Callable[[Callable[[], None]], Running] = _in_thread,
                 clock: Callable[[], float] = time.monotonic):
        self._spawn = spawn
        self.url = url
        self._say = say
        self.grace_s = grace_s
        self._before_stop = before_stop
        self.stop_timeout_s = stop_timeout_s
        self._signal_group = kill_group if signal_group is None else signal_group
        self._run_in_thread = run_in_thread
        self._clock = clock
        self.state = STARTING
        self.child: Child | None = None
        self.signalled = False
        self._kill_at: float | None = None  # grace period's end, once the child was told to stop
        self._flush: Running | None = None
        self._flush_until = 0.0

    def _signal(self, sig: int) -> None:
        if self.child is not None:
            self._signal_group(self.child.pid, sig)  # start_new_session: the child leads its group

    def start(self) -> Child:
        """Spawn the child (a signal that came first stops it at once when there is no flush to run)."""
        self.child = self._spawn()
        if self.state == STARTING:
            self.state = RUNNING
        elif self.state == STOPPING:  # signalled while it was starting
            self._signal(signal.SIGTERM)
        return self.child

    def ready(self) -> None:
        """``/health`` answered."""
        self._say(f"ready: {self.url}")
        if self.state == RUNNING:
            self.state = READY

    def on_signal(self) -> None:
        """SIGINT/SIGTERM: the first flushes (if there is a flush) then stops; a second kills."""
        if self.signalled:  # second Ctrl-C: no more waiting
            self._signal(signal.SIGKILL)
            return
        self.signalled = True
        if self._before_stop is None:
            self._stop_child()
        else:
            self.state = FLUSHING

    def _stop_child(self) -> None:
        self._kill_at = self._clock() + self.grace_s
        self.state = STOPPING
        self._signal(signal.SIGTERM)

    def tick(self) -> None:
        """While the child runs: start the flush, end it when done or late, kill after the grace period."""
        if self.state == FLUSHING:
            if self._flush is None:
                self._flush_until = self._clock() + self.stop_timeout_s
                self._flush = self._run_in_thread(self._flush_guarded)
            elif not self._flush.is_alive() or self._clock() > self._flush_until:
                if self._flush.is_alive():
                    self._say(f"flush did not finish within {self.stop_timeout_s:g} s; stopping anyway")
                self._stop_child()
        if self.state == STOPPING and self._kill_at is not None and self._clock() > self._kill_at:
            self._say(f"vLLM did not stop within {self.grace_s:g} s; killing it")
            self._signal(signal.SIGKILL)
            self.state = KILLED

    def _flush_guarded(self) -> None:
        if self._before_stop is None:
            return
        try:
            self._before_stop()
        except Exception as exc:  # noqa: BLE001 - stopping must go on whatever the flush met
            hint = getattr(exc, "hint", None)
            self._say(f"flush before stop failed: {exc}" + (f" ({hint})" if hint else ""))

    def finish(self, returncode: int) -> int:
        """The child exited: our exit status (0 for a clean stop after a signal, 128+N for signal N)."""
        killed = self.state == KILLED
        if self.signalled:
            self.state = STOPPED
            if returncode in (0, -signal.SIGTERM, -signal.SIGINT) and not killed:
                self._say("stopped")
                return 0
            return exit_status(returncode)
        self.state = EXITED
        self._say(f"vLLM exited with status {exit_status(returncode)}"
                  + ("" if returncode == 0 else " (its output is above)"))
        return exit_status(returncode)

    def run(self, wait_s: float = 0.2) -> int:
        """Watch the started child until it exits; returns :meth:`finish`'s status."""
        assert self.child is not None, "start() first"
        while True:
            try:
                return self.finish(self.child.wait(timeout=wait_s))
            except subprocess.TimeoutExpired:
                self.tick()


def run_server(
    cmd: Sequence[str],
    env: Mapping[str, str] | None,
    url: str,
    admin_socket_hint: str,
    *,
    say: Say = print,
    grace_s: float = GRACE_S,
    poll_s: float = 0.5,
    before_stop: Callable[[], None] | None = None,
    stop_timeout_s: float = 60.0,
) -> int:
    """Run ``cmd`` (vLLM's server) in its own process group until it exits or we are signalled.

    Prints the API URL, the admin socket and, once ``GET /health`` answers, "ready".  SIGINT/SIGTERM
    are forwarded to the child's group as SIGTERM (a second one SIGKILLs at once); a group still
    alive ``grace_s`` after the first signal is SIGKILLed.  Returns the child's exit status: 0 on a
    clean shutdown after a signal, 128+N when it died of signal N.  Must be called from the main
    thread (it installs signal handlers, restored on return).

    ``before_stop`` (kvtier's flush of dirty KV through the admin API) runs on the first signal,
    before vLLM is told to stop, for at most ``stop_timeout_s`` seconds; a second signal skips it.
    """
    say(f"API: {url}")
    say(f"admin socket: {admin_socket_hint} (kvtier status / sessions / top find it without flags)")
    supervisor = Supervisor(
        lambda: subprocess.Popen(list(cmd), env=None if env is None else dict(env), start_new_session=True),
        url, say=say, grace_s=grace_s, before_stop=before_stop, stop_timeout_s=stop_timeout_s)
    stop_polling = threading.Event()
    previous: dict[int, object] = {}
    poller = None
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda _signum, _frame: supervisor.on_signal())
        child = supervisor.start()
        poller = threading.Thread(target=wait_ready, name="kvtier-serve-ready", daemon=True,
                                  args=(health_url(url), child, stop_polling, supervisor.ready, poll_s))
        poller.start()
        return supervisor.run()
    finally:
        stop_polling.set()
        if supervisor.child is not None:
            reap_group(supervisor.child, grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        if poller is not None:
            poller.join(timeout=3)


# ---- the process-facing parts ---------------------------------------------------------------------
def health_url(url: str) -> str:
    """``/health`` of the server whose API is ``url`` (a wildcard host is asked on loopback)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme or "http", netloc, "/health", "", ""))


def wait_ready(health: str, child: Child, stop: threading.Event, on_ready: Callable[[], None],
               poll_s: float) -> None:
    """Poll ``health`` until it answers 200 (then ``on_ready()``), the child exits or ``stop`` is set."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP proxy
    while not stop.is_set() and child.poll() is None:
        try:
            with opener.open(health, timeout=2) as response:
                if response.status == 200:
                    if not stop.is_set():
                        on_ready()
                    return
        except Exception:  # noqa: BLE001, S110 - not up yet (refused, reset, 503 while loading...)
            pass
        stop.wait(poll_s)


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def kill_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when it is gone (or not ours)."""
    if pgid <= 1:  # 0 would be our own group
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def reap_group(child: subprocess.Popen, grace_s: float) -> None:
    """Leave nothing of ``child``'s process group behind (the child leads it: pgid == pid)."""
    pgid = child.pid
    if pgid <= 1:  # never signal our own group (0) or everything (-1 / 1)
        return
    if child.poll() is None:  # an exception (or KeyboardInterrupt) got us here
        kill_group(pgid, signal.SIGTERM)
        try:
            child.wait(timeout=min(grace_s, 10.0))
        except subprocess.TimeoutExpired:
            kill_group(pgid, signal.SIGKILL)
            child.wait()
    # The leader is gone; its own children (engine-core workers) may not be: clear the group.
    if group_alive(pgid) and kill_group(pgid, signal.SIGTERM):
        end = time.monotonic() + min(grace_s, 5.0)
        while time.monotonic() < end and group_alive(pgid):
            time.sleep(0.05)
        if group_alive(pgid):
            kill_group(pgid, signal.SIGKILL)


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in group ``pgid``.  Zombies are skipped: in a
    container whose init never reaps, orphans' zombies would otherwise look alive forever."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        entries = None
    if entries is None or not os.path.exists("/proc/self/stat"):
        return kill_group(pgid, 0)
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False
