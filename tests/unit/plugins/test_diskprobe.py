"""The worker's disk probe and the injected slow-disk fault (``kvtier.plugins.vllm.diskprobe``):
the fault file is polled only when ``KVTIER_FAULT_FILE`` is set, at most every ``POLL_S``; probes read
only while the scheduler half says the disk is slow, at most every ``PROBE_S``. Clock injected."""
from __future__ import annotations

import pytest
from support.clock import FakeClock

from kvtier.plugins.vllm import diskprobe
from kvtier.plugins.vllm.diskprobe import FAULT_ENV, PROBE_BYTES, DiskProbe, parse_fault
from kvtier.tiers import fileio


@pytest.fixture(autouse=True)
def healthy_disk_after():
    yield
    fileio.set_slowdown(1.0)


def slowdown() -> float:
    return fileio._slowdown


@pytest.mark.parametrize("text, factor", [("nvme_slowdown=10\n", 10.0), ("# nothing\n", 1.0), ("", 1.0),
                                          ("nvme_slowdown = 300  # 300x\n", 300.0), ("nvme_slowdown=0.5", 1.0),
                                          ("nvme_slowdown=fast", 1.0), ("other=3\nnvme_slowdown=4", 4.0)])
def test_fault_file_lines(text, factor):
    assert parse_fault(text) == factor


def test_the_fault_file_switches_the_slowdown_on_and_off(tmp_path, caplog):
    control = tmp_path / "fault"
    clock = FakeClock()
    probe = DiskProbe(None, lambda n, s: None, environ={FAULT_ENV: str(control)}, clock=clock,
                      stats=lambda: {"step_syncs": 0})
    probe.tick()
    assert slowdown() == 1.0  # no file: no fault
    control.write_text("nvme_slowdown=10\n")
    clock.advance(diskprobe.POLL_S / 2)
    probe.tick()
    assert slowdown() == 1.0  # polled at most every POLL_S
    clock.advance(diskprobe.POLL_S / 2)
    probe.tick()
    assert slowdown() == 10.0 and probe.factor == 10.0
    assert "INJECTED FAULT" in caplog.text and "step_syncs=0" in caplog.text
    control.write_text("nvme_slowdown=1  # recovered\n")
    clock.advance(diskprobe.POLL_S)
    probe.tick()
    assert slowdown() == 1.0
    control.write_text("nvme_slowdown=7\n")
    clock.advance(diskprobe.POLL_S)
    probe.tick()
    control.unlink()
    clock.advance(diskprobe.POLL_S)
    probe.tick()
    assert slowdown() == 1.0  # the file removed: the fault ends


def test_without_the_variable_nothing_is_polled(tmp_path, monkeypatch):
    monkeypatch.setattr(DiskProbe, "poll_fault", lambda self: pytest.fail("polled without KVTIER_FAULT_FILE"))
    probe = DiskProbe(None, lambda n, s: None, environ={}, clock=FakeClock())
    probe.tick()
    assert probe.fault_file is None
    assert DiskProbe.start(None, lambda n, s: None, None) is None  # no disk, no fault file: no thread


def test_probes_read_only_while_the_disk_is_slow(tmp_path):
    reports: list[tuple[int, float]] = []
    clock = FakeClock()
    probe = DiskProbe(tmp_path, lambda n, s: reports.append((n, s)), rank=1, environ={}, clock=clock)
    probe.tick()
    assert reports == [] and not probe.path.exists()  # healthy: nothing read, nothing written
    probe.wanted = True
    probe.tick()
    assert len(reports) == 1 and reports[0][0] == PROBE_BYTES and reports[0][1] > 0
    assert probe.path.name == ".kvtier-read-probe-1" and probe.path.stat().st_size == PROBE_BYTES
    probe.tick()
    assert len(reports) == 1  # at most every PROBE_S
    clock.advance(diskprobe.PROBE_S)
    probe.tick()
    assert len(reports) == 2 and probe.probes == 2
    probe.wanted = False
    clock.advance(diskprobe.PROBE_S)
    probe.tick()
    assert len(reports) == 2


def test_probe_reads_go_through_the_slowed_door(tmp_path, monkeypatch):
    """The probe reads with ``fileio.preadv``: an injected (or real) slowdown is what it measures."""
    calls = []
    real = fileio.preadv
    monkeypatch.setattr(fileio, "preadv", lambda fd, bufs, off: calls.append(off) or real(fd, bufs, off))
    probe = DiskProbe(tmp_path, lambda n, s: None, environ={}, clock=FakeClock())
    probe.wanted = True
    probe.tick()
    assert calls == [0]


def test_start_takes_the_first_drive(tmp_path):
    class Drives:
        roots = [tmp_path / "a", tmp_path / "b"]

    import threading

    stop = threading.Event()
    stop.set()  # the thread ends at once
    probe = DiskProbe.start(Drives(), lambda n, s: None, stop, rank=0)
    assert probe is not None and probe.directory == tmp_path / "a"
