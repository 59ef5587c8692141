"""The engine's steps, timed, for the connector's scheduler half: the cost model (link rates measured
at start and re-measured while serving, once the engine is quiet; the prefill model fitted from the
steps that run one prefill chunk alone) and how long the engine has been idle."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from kvtier.plan.costmodel import DEFAULT_RATES, CostModel, measure_rates, parse_link_caps

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.connector_config import ConnectorConfig

__all__ = ["EngineClock", "build_cost_model", "wait_until_quiet"]

log = logging.getLogger("kvtier.connector")


def wait_until_quiet(idle_for: Any, stopping: threading.Event, quiet_s: float, patience_s: float) -> bool | None:
    """Wait until ``idle_for()`` (seconds without engine activity) reaches ``quiet_s``, for at most
    ``patience_s``. True: quiet; False: still busy after all that patience; None: ``stopping`` set."""
    deadline = time.monotonic() + patience_s
    while True:
        idle = idle_for()
        if idle >= quiet_s:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if stopping.wait(min(left, max(quiet_s - idle, 0.05))):
            return None


def build_cost_model(config: "ConnectorConfig", geometry: Any, warm_codec: str, cold_codec: str,
                     nvme_dir: str | None) -> CostModel:
    """Measured link rates (at start; ``link_gbps`` caps them) and a prefill model that the
    engine's own step timings fit as it serves. ``warm_codec``/``cold_codec``: resolved specs."""
    from kvtier.codecs import get_codec

    caps = parse_link_caps(config.link_gbps)
    if not config.measure_links:
        rates = DEFAULT_RATES.capped(caps)
    else:
        try:
            rates = measure_rates(nvme_dir, caps, quick=True)
        except Exception as exc:  # noqa: BLE001 - a failed measurement must not stop the engine
            log.warning("kvtier: link measurement failed (%s); using defaults", exc)
            rates = DEFAULT_RATES.capped(caps)
    model = CostModel(rates, geometry.block_tokens, get_codec(warm_codec).max_bytes(geometry),
                      get_codec(cold_codec).max_bytes(geometry),
                      lossy=warm_codec != "none" or cold_codec != "none")
    log.info("kvtier: host->device %.2f GB/s, NVMe reads %.2f GB/s (%s)", rates.host_to_device_bps / 1e9,
             rates.nvme_read_bps / 1e9, rates.source)
    return model


class EngineClock:
    """The engine's steps, timed: they teach ``cost`` its prefill model, and tell the link
    re-measurement when the engine is quiet. ``count``: the manager's counter (``Telemetry.count``)."""

    def __init__(self, config: "ConnectorConfig", cost: CostModel, count: Callable[[str], None], requests: dict,
                 nvme_dir: str | None, stopping: threading.Event):
        self.config, self.cost, self.count, self.requests = config, cost, count, requests
        self._stopping = stopping
        self._last_step = 0.0  # monotonic time of the last step start or end: the rate refresher waits for quiet
        self._steps: deque = deque()  # (start time, prefill shape or None) of steps in flight
        self.rates_sink: Callable[[Any], None] = cost.refresh_rates  # where re-measured rates go (DiskWatch)
        if config.rates_refresh_s > 0 and config.measure_links:
            threading.Thread(target=self._refresh_rates, args=(nvme_dir, config.rates_refresh_s),
                             name="kvtier-rates", daemon=True).start()

    def _refresh_rates(self, nvme_dir: str | None, every_s: float) -> None:
        """Re-measure the links every ``every_s`` seconds while serving (a link can degrade: PCIe
        falls back a generation, a disk fills or throttles). Caps still apply. A measurement copies
        and reads tens of MB: it waits for a quiet engine, so that it neither slows a forward pass
        nor measures a link that a forward pass is using; after another period of waiting it runs
        anyway (a box that is never idle still gets fresh figures)."""
        caps = parse_link_caps(self.config.link_gbps)
        while not self._stopping.wait(every_s):
            quiet = wait_until_quiet(self.idle_for, self._stopping, quiet_s=min(1.0, every_s), patience_s=every_s)
            if quiet is None:
                return  # shutting down
            if not quiet:
                self.count("rate_refreshes_busy")
            try:
                rates = measure_rates(nvme_dir, caps, quick=True)
            except Exception as exc:  # noqa: BLE001 - keep the last good figures
                log.warning("kvtier: link re-measurement failed (%s); keeping the last figures", exc)
                continue
            self.rates_sink(rates)
            self.count("rate_refreshes")

    def idle_for(self) -> float:
        """Seconds since the engine last started or finished a step; 0 while a step is running."""
        return 0.0 if self._steps else time.monotonic() - self._last_step

    def prefill_shape(self, scheduler_output: Any) -> tuple[int, int] | None:
        """(start, tokens) when this step runs one prefill chunk and nothing else: its forward time
        is a clean sample for the cost model."""
        scheduled = scheduler_output.num_scheduled_tokens
        if len(scheduled) != 1:
            return None
        req_id, tokens = next(iter(scheduled.items()))
        state = self.requests.get(req_id)
        if state is None:
            return None
        request = state.request
        start = request.num_computed_tokens  # not yet advanced: vLLM builds our metadata first
        if start + tokens > getattr(request, "num_prompt_tokens", request.num_tokens):
            return None  # this step also decodes
        return start, tokens

    def step_started(self, scheduler_output: Any) -> None:
        """A step is about to run (vLLM builds our metadata right before executing it)."""
        if not getattr(scheduler_output, "total_num_scheduled_tokens", 0):
            return
        self._last_step = time.monotonic()
        self._steps.append((time.perf_counter(), self.prefill_shape(scheduler_output)))
        if len(self._steps) > 4:  # steps we were never told the end of: start over
            self._steps.clear()

    def step_finished(self) -> None:
        """The oldest step's output is in: a prefill-only step's wall time (forward, sampling, and
        kvtier's own synchronous stores, which a recompute pays too) teaches the prefill model.
        With two steps in flight (async scheduling) the interval overlaps another step: skipped."""
        if not self._steps:
            return
        self._last_step = time.monotonic()
        started, shape = self._steps.popleft()
        if shape is not None and not self._steps:
            self.cost.observe_prefill(shape[0], shape[1], time.perf_counter() - started)
