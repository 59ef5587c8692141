"""The supervisor of ``kvtier serve``'s vLLM child, as a state machine: its transitions walked with a
fake child, a fake clock and a fake flush thread (no process, no thread, no real time). The real
process-facing behaviour (signals, groups, reaping) is tested with a fake server in test_serve.py."""
from __future__ import annotations

import signal
import subprocess

from support.clock import FakeClock

from kvtier.launch.supervisor import Supervisor


class FakeChild:
    pid = 4242

    def poll(self):
        return None

    def wait(self, timeout=None):
        raise subprocess.TimeoutExpired("vllm", timeout)


class FakeFlush:
    """The flush 'thread': its action runs when the test says, and it is alive until then."""

    def __init__(self, action):
        self.action, self.done = action, False

    def is_alive(self):
        return not self.done

    def finish(self):
        self.action()
        self.done = True


def supervisor(clock, before_stop=None):
    said, sent, flushes = [], [], []

    def run_in_thread(action):
        flushes.append(FakeFlush(action))
        return flushes[-1]

    sup = Supervisor(FakeChild, "http://127.0.0.1:8000/v1", say=said.append, grace_s=30, before_stop=before_stop,
                     stop_timeout_s=60, signal_group=lambda pgid, sig: sent.append((pgid, sig)) or True,
                     run_in_thread=run_in_thread, clock=clock)
    return sup, said, sent, flushes


def test_supervisor_stops_on_a_signal_and_kills_after_the_grace_period():
    clock = FakeClock()
    sup, said, sent, _ = supervisor(clock)
    assert sup.state == "starting"
    sup.start()
    assert sup.state == "running" and sent == []
    sup.ready()
    assert sup.state == "ready" and said == ["ready: http://127.0.0.1:8000/v1"]
    sup.on_signal()
    assert sup.state == "stopping" and sent == [(4242, signal.SIGTERM)]
    clock.advance(29)
    sup.tick()
    assert sup.state == "stopping" and len(sent) == 1  # still within its grace period
    clock.advance(2)
    sup.tick()
    assert sup.state == "killed" and sent[-1] == (4242, signal.SIGKILL)
    assert said[-1] == "vLLM did not stop within 30 s; killing it"
    assert sup.finish(-signal.SIGKILL) == 128 + signal.SIGKILL and sup.state == "stopped"


def test_supervisor_flushes_first_and_a_late_flush_does_not_hold_the_stop():
    clock, flushed = FakeClock(), []
    sup, said, sent, flushes = supervisor(clock, before_stop=lambda: flushed.append(True))
    sup.start()
    sup.on_signal()
    assert sup.state == "flushing" and sent == [] and flushes == []
    sup.tick()
    assert len(flushes) == 1 and sent == []  # the flush runs while vLLM is still up
    clock.advance(59)
    sup.tick()
    assert sup.state == "flushing" and sent == []
    clock.advance(2)
    sup.tick()
    assert said[-1] == "flush did not finish within 60 s; stopping anyway"
    assert sup.state == "stopping" and sent == [(4242, signal.SIGTERM)] and flushed == []
    assert sup.finish(-signal.SIGTERM) == 0 and said[-1] == "stopped"


def test_supervisor_stops_once_the_flush_is_done_and_a_second_signal_kills():
    clock, flushed = FakeClock(), []
    sup, said, sent, flushes = supervisor(clock, before_stop=lambda: flushed.append(True))
    sup.on_signal()  # signalled while vLLM was starting: the flush still comes first
    sup.start()
    assert sup.state == "flushing" and sent == []
    sup.tick()
    flushes[0].finish()
    sup.tick()
    assert flushed == [True] and sup.state == "stopping" and sent == [(4242, signal.SIGTERM)]
    sup.on_signal()
    assert sent[-1] == (4242, signal.SIGKILL)
    assert sup.finish(-signal.SIGKILL) == 128 + signal.SIGKILL and "stopped" not in said


def test_supervisor_reports_a_child_that_exits_by_itself():
    sup, said, sent, _ = supervisor(FakeClock())
    sup.start()
    assert sup.finish(5) == 5 and sup.state == "exited" and sent == []
    assert said == ["vLLM exited with status 5 (its output is above)"]
    sup, said, _, _ = supervisor(FakeClock())
    sup.on_signal()  # before it started, with no flush to run: it is told to stop as soon as it is there
    sup.start()
    assert sup.state == "stopping"
    assert sup.finish(0) == 0 and said == ["stopped"]
