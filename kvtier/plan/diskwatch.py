"""The NVMe tier's live read speed, fed back into the cost model.

The cost model's NVMe figures (read bandwidth, first-byte latency) are measured at start and every
few minutes after (``measure_rates``). A disk can turn slow in between -- a failing drive, a noisy
neighbour, a RAID rebuild -- and a model that still believes the start-up figure keeps loading
sessions from a disk that now loses to recomputing them. So the worker reports how long each of its
NVMe reads took (a load's or a promotion's reads, ``JobResult.nvme_read_s`` / ``nvme_read_bytes``,
and, while the disk is slow, a small probe read of its own every second), and ``DiskWatch`` compares
each with what the measured figures predict for the same bytes:

    ratio = seconds / (nvme_latency_s + bytes / nvme_read_bps)

Over the last ``window`` (3) reads the median ratio is the disk's slowdown. At ``slow_ratio`` (3) or
more the cost model plans with the measured figures scaled by it (bandwidth / ratio, latency x
ratio); below it, with the measured figures as they are (this box's disk swings 2-3x from one
second to the next: that is noise, not a slow disk). A 10x slower disk is seen at the second slow
read; a recovered one at the second healthy read, which the worker's probes provide within a few
seconds even while no turn loads from NVMe (the model then recomputes everything the disk holds).

A re-measurement (``measured_rates``) becomes the new reference: on a disk that is really slow it
is slow too, and the ratios fall back towards 1 while the model keeps the slow figures.
"""
from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.plan.costmodel import CostModel, LinkRates

__all__ = ["DiskWatch", "SLOW_RATIO", "WINDOW"]

log = logging.getLogger("kvtier.connector")

SLOW_RATIO = 3.0  # reads this many times slower than measured (median of the window): a slow disk
HEALTHY_RATIO = 1.5  # ... and back under this: healthy again (between the two, as it was: no flapping)
WINDOW = 3  # the last reads the median is taken over


class DiskWatch:
    """Keeps ``cost``'s NVMe figures in step with the reads the worker reports. ``warn(name,
    message)``: the manager's lasting warning (None clears it). ``clock``: for the change log."""

    def __init__(self, cost: "CostModel", warn: Callable[[str, str | None], None] | None = None,
                 window: int = WINDOW, slow_ratio: float = SLOW_RATIO, clock: Callable[[], float] = time.monotonic,
                 shards: int = 1):
        self.cost, self.warn, self.slow_ratio, self.clock = cost, warn, slow_ratio, clock
        self.shards = max(1, shards)  # tensor-parallel ranks reading their shards from the disk at once
        self._lock = threading.Lock()  # the scheduler's results and the rates thread's re-measurements
        self.measured: "LinkRates" = cost.rates  # the reference: the last measurement (caps applied)
        self.ratios: deque[float] = deque(maxlen=window)
        self.slowdown = 1.0  # what the cost model plans with now (1: the measured figures)
        self.reads = 0  # reads observed
        self.changes: list[tuple[float, float, int]] = []  # (clock, slowdown, reads) each time slow <-> healthy

    @property
    def slow(self) -> bool:
        """The model plans with a slowed disk (the worker then probes it, so a recovery is seen)."""
        return self.slowdown > 1.0

    def predicted_s(self, nbytes: int) -> float:
        rates = self.measured
        return rates.nvme_latency_s + nbytes / rates.nvme_read_bps

    def observe_result(self, result: Any) -> None:
        """A worker's result: its NVMe reads, if it made any."""
        nbytes, seconds = getattr(result, "nvme_read_bytes", 0), getattr(result, "nvme_read_s", 0.0)
        if nbytes > 0 and seconds > 0 and getattr(result, "rank", 0) == 0:  # one rank for all: they read
            self.observe(nbytes * self.shards, seconds)  # their shards at once, sharing the disk

    def observe(self, nbytes: int, seconds: float) -> None:
        """``nbytes`` read from the NVMe tier in ``seconds``."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self.reads += 1
            self.ratios.append(seconds / self.predicted_s(nbytes))
            median = statistics.median(self.ratios)
            threshold = HEALTHY_RATIO if self.slow else self.slow_ratio
            self._plan(median if median >= threshold else 1.0)

    def measured_rates(self, rates: "LinkRates") -> None:
        """A fresh measurement of the links (the background re-measurement): the new reference, except
        that while the disk is slow a slower NVMe figure is the slow disk measured, not a new healthy
        one: the healthy reference stays (else the slowdown would vanish while the disk is still slow)."""
        with self._lock:
            if self.slow and rates.nvme_read_bps < self.measured.nvme_read_bps:
                rates = replace(rates, nvme_read_bps=self.measured.nvme_read_bps,
                                nvme_latency_s=self.measured.nvme_latency_s,
                                source=dict(rates.source, nvme_read_bps=self.measured.source.get("nvme_read_bps",
                                                                                             "measured")))
            self.measured = rates
            self._apply(rates)

    def follow(self, clock: Any) -> "DiskWatch":
        """Take the background re-measurements of ``clock`` (an ``EngineClock``) as the reference."""
        clock.rates_sink = self.measured_rates
        return self

    def _plan(self, slowdown: float) -> None:
        if slowdown == self.slowdown:
            return
        turned = (slowdown > 1.0) != self.slow
        self.slowdown = slowdown
        self._apply()
        if turned:
            self.changes.append((self.clock(), slowdown, self.reads))
            del self.changes[:-64]
        if not self.slow:
            log.warning("kvtier: NVMe reads are back to the measured speed: loads from NVMe resume")
            if self.warn is not None:
                self.warn("nvme_slow", None)
            return
        gbps = self.cost.rates.nvme_read_bps / 1e9
        message = (f"NVMe reads take {slowdown:.1f}x the measured time (median of the last {len(self.ratios)}): "
                   f"loads from NVMe are planned at {gbps:.3f} GB/s, and recomputed where that loses")
        if turned:
            log.warning("kvtier: %s", message)
        if self.warn is not None:
            self.warn("nvme_slow", message)

    def _apply(self, rates: "LinkRates | None" = None) -> None:
        """The cost model's NVMe figures: the reference's, scaled by the slowdown. Only those: the
        other figures stay as the model has them (``rates``: a whole new measurement instead)."""
        base = rates or self.cost.rates
        nvme_bps, latency = self.measured.nvme_read_bps, self.measured.nvme_latency_s
        source = dict(base.source, nvme_read_bps=self.measured.source.get("nvme_read_bps", "measured"))
        if self.slow:
            nvme_bps, latency = nvme_bps / self.slowdown, latency * self.slowdown
            source["nvme_read_bps"] = (f"{source['nvme_read_bps']} / {self.slowdown:.1f}: median of the last "
                                       f"{len(self.ratios)} NVMe reads")
        self.cost.refresh_rates(replace(base, nvme_read_bps=nvme_bps, nvme_latency_s=latency, source=source))

    def report(self) -> dict:
        return {"slowdown": self.slowdown, "reads": self.reads, "ratios": [round(r, 2) for r in self.ratios],
                "measured_nvme_read_gbps": self.measured.nvme_read_bps / 1e9}
