"""A disk that turns slow while serving: the worker's NVMe read times reach the cost model
(``kvtier.plan.diskwatch``), which then recomputes what loading from the slow disk would lose, and
loads again once the reads are back to the measured speed. No sleeps: reads are reported with the
seconds they took, the clock is injected."""
from __future__ import annotations

import pytest
from support.clock import FakeClock

from kvtier.jobs import JobKind, JobResult
from kvtier.plan.costmodel import GB, CostModel, LinkRates, PrefillModel
from kvtier.plan.diskwatch import DiskWatch

BT = 128
BLOCK = 256 << 10  # the tiny demo model's block: 2 KiB of KV per token
# a prefill of 50 us per token: recomputing a 64-block (8,192-token) session takes ~0.43 s
PREFILL = PrefillModel(overhead_s=0.01, per_token_s=50e-6, attention_s=1e-10)
MEASURED = LinkRates(20 * GB, 1.0 * GB, nvme_latency_s=2e-4, job_latency_s=3e-4, source={"nvme_read_bps": "O_DIRECT"})


def watch(clock=None, shards: int = 1) -> tuple[DiskWatch, CostModel, dict]:
    cost = CostModel(MEASURED, BT, BLOCK, BLOCK, prefill=PREFILL)
    warnings: dict[str, str] = {}

    def warn(name: str, message: str | None) -> None:
        if message:
            warnings[name] = message
        else:
            warnings.pop(name, None)

    return DiskWatch(cost, warn, clock=clock or FakeClock(), shards=shards), cost, warnings


def read_s(nbytes: int, slowdown: float) -> float:
    """What a read of ``nbytes`` takes on the measured disk slowed ``slowdown`` times."""
    return slowdown * (MEASURED.nvme_latency_s + nbytes / MEASURED.nvme_read_bps)


def reads(dw: DiskWatch, slowdown: float, count: int = 3, nbytes: int = 16 << 20) -> None:
    """``count`` reads of ``nbytes`` on the measured disk slowed ``slowdown`` times."""
    for _ in range(count):
        dw.observe(nbytes, read_s(nbytes, slowdown))


def decision(cost: CostModel, blocks: int = 64) -> str:
    split = cost.best_split(0, [False] * blocks, blocks * BT + 10)  # a session wholly on NVMe
    assert split is not None
    return split.decision


def test_healthy_reads_leave_the_measured_figures_alone():
    dw, cost, warnings = watch()
    for slowdown in (1.0, 2.5, 0.6, 1.4, 2.9):  # this box's disk swings 2-3x: noise, not a slow disk
        dw.observe(16 << 20, read_s(16 << 20, slowdown))
    assert not dw.slow and cost.rates == MEASURED and warnings == {}
    assert decision(cost) == "load"


def test_a_disk_200x_slower_is_noticed_at_its_second_read_and_turns_loads_into_recomputes():
    clock = FakeClock()
    dw, cost, warnings = watch(clock)
    reads(dw, 1.0, 3)
    assert decision(cost) == "load"
    reads_to_notice = 0
    while not dw.slow:
        reads_to_notice += 1
        assert reads_to_notice <= 5, "not noticed within five loads"
        dw.observe(16 << 20, read_s(16 << 20, 200.0))
    assert reads_to_notice == 2  # the median of the last three turns at the second slow read
    assert dw.slowdown == pytest.approx(200.0)
    assert cost.rates.nvme_read_bps == pytest.approx(MEASURED.nvme_read_bps / 200)
    assert cost.rates.nvme_latency_s == pytest.approx(MEASURED.nvme_latency_s * 200)
    assert "200.0x" in warnings["nvme_slow"] and "median of the last 3" in cost.rates.source["nvme_read_bps"]
    assert decision(cost) == "recompute"
    assert cost.break_even_tokens(from_nvme=True) is None  # demotion stops writing sessions it can't restore
    [(when, slowdown, seen)] = dw.changes
    assert (when, seen) == (clock.now, 5) and slowdown == pytest.approx(200.0)


def test_a_10x_slower_disk_is_seen_but_still_loads_where_loading_wins():
    dw, cost, _warnings = watch()
    reads(dw, 10.0, 2)
    assert dw.slow and dw.slowdown == pytest.approx(10.0)
    assert decision(cost) == "load"  # 64 blocks at 0.1 GB/s: 0.17 s, recompute 0.43 s


def test_a_recovered_disk_is_seen_from_two_probe_reads():
    clock = FakeClock()
    dw, cost, warnings = watch(clock)
    reads(dw, 200.0, 3)
    assert decision(cost) == "recompute"
    clock.advance(30)
    probe = JobResult(job_id=-1, kind=JobKind.PROMOTE, ok=True, nvme_read_bytes=2 << 20,
                      nvme_read_s=read_s(2 << 20, 1.0))
    dw.observe_result(probe)
    assert dw.slow  # one healthy read among two slow ones: the median is still slow
    dw.observe_result(probe)
    assert not dw.slow and cost.rates == MEASURED and "nvme_slow" not in warnings
    assert decision(cost) == "load"
    assert [(when, round(slowdown)) for when, slowdown, _reads in dw.changes] == [(1000.0, 200), (1030.0, 1)]


def test_results_without_nvme_reads_are_not_observations():
    dw, cost, _warnings = watch()
    dw.observe_result(JobResult(job_id=3, kind=JobKind.LOAD, ok=True, bytes_moved=1 << 20, seconds=5.0))
    dw.observe(0, 1.0)
    dw.observe(1 << 20, 0.0)
    assert dw.reads == 0 and not dw.slow


def test_a_re_measurement_is_the_new_reference_and_keeps_a_slowdown_in_force():
    dw, cost, _warnings = watch()
    reads(dw, 50.0, 2)
    faster = LinkRates(20 * GB, 2.0 * GB, nvme_latency_s=2e-4, job_latency_s=3e-4)
    dw.measured_rates(faster)  # the background re-measurement (which an injected fault does not slow)
    assert dw.measured is faster
    assert cost.rates.nvme_read_bps == pytest.approx(2.0 * GB / 50)
    dw.observe(16 << 20, 0.008)  # 2 GB/s: healthy against the new reference
    dw.observe(16 << 20, 0.008)
    assert cost.rates == faster


def test_rank_results_merge_their_read_times():
    a = JobResult(job_id=1, kind=JobKind.LOAD, ok=True, rank=0, nvme_read_bytes=4 << 20, nvme_read_s=0.01)
    b = JobResult(job_id=1, kind=JobKind.LOAD, ok=True, rank=1, nvme_read_bytes=4 << 20, nvme_read_s=0.05)
    merged = a.merge(b)
    assert merged.nvme_read_bytes == 4 << 20 and merged.nvme_read_s == 0.05  # the slower rank's shard


def test_between_the_two_thresholds_the_disk_stays_as_it_was():
    """Slow from 3x, healthy again under 1.5x: a disk whose reads wobble around 2x (a write in flight
    beside them) neither enters nor leaves the slow state on that."""
    dw, cost, _warnings = watch()
    reads(dw, 2.2, 3)
    assert not dw.slow
    reads(dw, 20.0, 3)
    assert dw.slow
    reads(dw, 2.2, 3)
    assert dw.slow and dw.slowdown == pytest.approx(2.2)  # still planned as slow, at what it measures
    reads(dw, 1.0, 2)
    assert not dw.slow and cost.rates == MEASURED


def test_a_slow_re_measurement_during_a_slow_episode_keeps_the_healthy_reference():
    """A real slow disk slows the background re-measurement too: taken as the new reference, it would
    make the slow reads look healthy and end the episode while the disk is still slow."""
    dw, cost, _warnings = watch()
    reads(dw, 50.0, 2)
    slow_measurement = LinkRates(20 * GB, MEASURED.nvme_read_bps / 50, nvme_latency_s=1e-2, job_latency_s=3e-4)
    dw.measured_rates(slow_measurement)
    assert dw.measured.nvme_read_bps == MEASURED.nvme_read_bps
    dw.observe(16 << 20, read_s(16 << 20, 50.0))
    assert dw.slow and cost.rates.nvme_read_bps == pytest.approx(MEASURED.nvme_read_bps / 50)


def test_tensor_parallel_ranks_count_once_for_the_disk_they_share():
    dw, _cost, _warnings = watch(shards=4)
    for rank in range(4):  # each rank read its quarter in the time the disk takes for all four
        dw.observe_result(JobResult(job_id=1, kind=JobKind.LOAD, ok=True, rank=rank, nvme_read_bytes=4 << 20,
                                    nvme_read_s=read_s(16 << 20, 1.0)))
    assert dw.reads == 1 and not dw.slow


def test_a_slow_disk_changes_only_the_nvme_figures_the_model_has():
    """A link capped or re-measured by someone else (the host link crawling) stays as it is when the
    disk's slowdown is applied or lifted: DiskWatch owns the NVMe figures only."""
    dw, cost, _warnings = watch()
    cost.refresh_rates(cost.rates.capped({"pcie": 1e-6}))
    reads(dw, 200.0)
    assert dw.slow and cost.rates.host_to_device_bps == pytest.approx(1e-6 * GB)
    reads(dw, 1.0, 2)
    assert not dw.slow and cost.rates.host_to_device_bps == pytest.approx(1e-6 * GB)
    assert cost.rates.nvme_read_bps == MEASURED.nvme_read_bps
