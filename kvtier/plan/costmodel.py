"""Load or recompute: the measured cost model behind every load decision.

Predicted time to load a stored prefix into HBM:

    round trip + job latency
    + DRAM blocks:  bytes / host->device bandwidth
    + NVMe blocks:  NVMe latency + bytes / NVMe read bandwidth + bytes / host->device bandwidth
    + lossy codecs: payload bytes / decode bandwidth

(NVMe reads and the host->device copy are counted in series: the mover stages NVMe blocks through
DRAM. That is the conservative side of the mover's real overlap.) The round trip is what an
asynchronous load adds to the request outside the mover: vLLM schedules the load in one step and the
rest of the prompt only in a later one, once the worker reports the load done, so a restore pays one
engine step without a forward pass (scheduler pass, connector metadata, the worker's report) that a
recompute does not. The mover's own job timings never include it. Nor do they include what the
step right after a load loses to it (on the CPU backend the load's copies leave that step slower
than the same prefill without a load): the model measures that ratio on the restores it sees
(``after_load_factor``), applies it to a load's tail, and keeps those steps out of the prefill fit.
A TTFT also holds vLLM's handling of the request outside every engine step (``request_seconds``,
measured from each request's arrival to its first scheduling): loads and recomputes pay it alike,
so it decides nothing, but ``restore_seconds`` includes it.

Predicted time to recompute ``n`` tokens that start at position ``s`` of a prompt (chunked prefill
of the served model), fitted from the engine's own step timings:

    overhead + a * n + b * (n * s + n^2 / 2)

``a`` is the per-token cost of the weights (MLP, projections), ``b`` the attention term: token
``i`` attends to ``i`` earlier tokens, so the work of a chunk grows with where it starts.

A hit is then loaded in full, in part (the front, when loading its tail costs more than
recomputing it: e.g. NVMe blocks behind DRAM ones on a slow disk), or not at all; ``best_split``
picks the split that minimizes load + recompute, as in Cake (Jin et al., 2024). Until the model
has seen enough prefill steps to fit, every hit is loaded (what a cache does without a model).

Bandwidths are measured at start (``measure_rates``) and can be capped with ``link_gbps`` (e.g.
``{"pcie": 3.9}``) to reproduce a slow link on any machine. While serving they are refreshed two
ways: the mover's own DRAM loads refit the per-job latency and the per-byte cost of a load
(``observe_load``; from the first one the per-byte cost, from a few of different sizes both), and
the scheduler re-measures the links in the background every few minutes
(``refresh_rates``), caps still applied.

The same model decides what is worth keeping: a session is demoted to NVMe only when restoring it
from there will beat recomputing it (``break_even_tokens(from_nvme=True)``), and a prefix shorter
than the DRAM break-even is not stored at all (``kvtier.plan.decide``).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["LinkRates", "PrefillModel", "CostModel", "Split", "measure_rates", "parse_link_caps",
           "DEFAULT_RATES"]

GB = 1e9


@dataclass(frozen=True)
class LinkRates:
    host_to_device_bps: float  # DRAM -> HBM (pinned copy on CUDA; memcpy into the KV cache on CPU)
    nvme_read_bps: float  # direct-IO reads from the NVMe directory
    nvme_latency_s: float = 200e-6  # first byte of a read
    job_latency_s: float = 300e-6  # fixed cost of one load job in the mover (planning, metadata, sync)
    # the engine step an asynchronous load adds to its request (see the module docstring): ~1.3-1.5 ms
    # on the 2-core CPU dev box (vLLM's scheduler pass and the step's bookkeeping, no forward pass)
    round_trip_s: float = 1.5e-3
    decode_bps: float | None = None  # lossy codec decode (None: no lossy codec)
    source: dict = field(default_factory=dict, compare=False)  # how each figure was obtained

    def capped(self, caps: dict[str, float]) -> "LinkRates":
        """Cap links at ``caps`` GB/s (``pcie`` for host->device, ``nvme`` for disk reads)."""
        h2d, nvme = self.host_to_device_bps, self.nvme_read_bps
        source = dict(self.source)
        if "pcie" in caps:
            h2d = min(h2d, caps["pcie"] * GB)
            source["host_to_device_bps"] = f"capped at {caps['pcie']} GB/s"
        if "nvme" in caps:
            nvme = min(nvme, caps["nvme"] * GB)
            source["nvme_read_bps"] = f"capped at {caps['nvme']} GB/s"
        return replace(self, host_to_device_bps=h2d, nvme_read_bps=nvme, source=source)


# Used until measurements exist: a PCIe gen4 x16 link and a datacenter NVMe drive.
DEFAULT_RATES = LinkRates(host_to_device_bps=20 * GB, nvme_read_bps=3 * GB, source={"all": "defaults"})


def parse_link_caps(spec: str | dict | None) -> dict[str, float]:
    """``"pcie=3.9,nvme=1.5"`` (GB/s) -> ``{"pcie": 3.9, "nvme": 1.5}``."""
    from kvtier.errors import UsageError

    if not spec:
        return {}
    if isinstance(spec, dict):
        items = spec.items()
    else:
        items = []
        for part in str(spec).split(","):
            name, sep, value = part.partition("=")
            if not sep:
                raise UsageError(f"bad link cap {part!r}", hint="e.g. --link-gbps pcie=3.9,nvme=1.5 (GB/s)")
            items.append((name.strip(), value.strip()))
    caps = {}
    for name, value in items:
        if name not in ("pcie", "nvme"):
            raise UsageError(f"unknown link {name!r}", hint="links: pcie (host<->GPU), nvme (disk reads)")
        try:
            caps[name] = float(value)
        except (TypeError, ValueError):
            raise UsageError(f"link cap {name}={value!r} is not a number", hint="GB/s, e.g. pcie=3.9") from None
        if not 0 < caps[name] < 10_000:
            raise UsageError(f"link cap {name}={value} is out of range", hint="GB/s, between 0 and 10000")
    return caps


@dataclass(frozen=True)
class PrefillModel:
    overhead_s: float
    per_token_s: float
    attention_s: float  # per (token x earlier token)
    points: int = 0

    def seconds(self, start: float | np.ndarray, tokens: float | np.ndarray) -> float | np.ndarray:
        """Time to prefill ``tokens`` tokens starting at position ``start``."""
        tokens = np.asarray(tokens, dtype=np.float64)
        work = self.per_token_s * tokens + self.attention_s * (tokens * start + tokens * tokens / 2)
        return np.where(tokens > 0, self.overhead_s + work, 0.0) if work.ndim else \
            (float(self.overhead_s + work) if tokens > 0 else 0.0)

    @classmethod
    def fit(cls, points: Sequence[tuple[int, int, float]]) -> "PrefillModel | None":
        """Least squares over (start, tokens, seconds) samples; None until there are enough distinct
        shapes to tell the linear and the attention terms apart."""
        if len(points) < 3 or len({(s, n) for s, n, _ in points}) < 3:
            return None
        data = np.asarray(points, dtype=np.float64)
        start, tokens, seconds = data[:, 0], data[:, 1], data[:, 2]
        design = np.stack([np.ones_like(tokens), tokens, tokens * start + tokens * tokens / 2], axis=1)
        if tokens.max() < 2 * tokens.min():
            # every step had about the same size (full prefill chunks): a fixed cost per step cannot
            # be told apart from a per-token one, and a fitted overhead would be wild for short
            # chunks. Fold it into the per-token cost: short steps are then under-predicted, which
            # errs towards recomputing (never slower than having no cache).
            design[:, 0] = 0.0
        # relative error matters (a 16k prefill is seconds, a short one milliseconds): weight by 1/t
        weight = 1.0 / np.maximum(seconds, 1e-4)
        coef = _nonnegative_lstsq(design * weight[:, None], seconds * weight)
        if coef[1] <= 0 and coef[2] <= 0:
            return None
        return cls(float(coef[0]), float(coef[1]), float(coef[2]), len(points))


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (three unknowns: try each active set)."""
    best, best_err = np.zeros(a.shape[1]), float(np.sum(b * b))
    n = a.shape[1]
    for mask in range(1, 1 << n):
        cols = [i for i in range(n) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if np.any(coef < 0):
            continue
        full = np.zeros(n)
        full[cols] = coef
        err = float(np.sum((a @ full - b) ** 2))
        if err < best_err:
            best, best_err = full, err
    return best


@dataclass(frozen=True)
class Split:
    blocks: int  # load the first ``blocks`` of the hit, recompute the rest
    hit_blocks: int
    load_s: float  # predicted time to load them
    recompute_s: float  # predicted time to prefill what follows (to the end of the prompt)
    all_load_s: float  # total with the whole hit loaded, and with nothing loaded (for reports)
    none_load_s: float

    @property
    def decision(self) -> str:
        return "recompute" if self.blocks == 0 else "load" if self.blocks == self.hit_blocks else "split"

    @property
    def total_s(self) -> float:
        return self.load_s + self.recompute_s


class CostModel:
    """Predicts load and recompute times for one served model on this box."""

    WARMUP_STEPS = 2  # the first forwards pay one-time costs (allocation, compilation): not a sample
    MIN_SAMPLES = 6

    def __init__(self, rates: LinkRates, block_tokens: int, dram_block_bytes: int, nvme_block_bytes: int,
                 prefill: PrefillModel | None = None, lossy: bool = False, margin: float = 0.10):
        self.rates = rates
        self.block_tokens = block_tokens
        self.dram_block_bytes = dram_block_bytes
        self.nvme_block_bytes = nvme_block_bytes
        self.prefill = prefill
        self.lossy = lossy
        self.margin = margin  # recompute (part of) a hit only when predicted at least this much faster
        self._samples: list[tuple[int, int, float]] = []
        self._seen = 0
        self._loads: list[tuple[float, float]] = []  # (bytes, seconds) of DRAM-only load jobs
        self.load_fit: tuple[float, float] | None = None  # (job latency s, s per byte), from ``_loads``
        self._break_even: dict[bool, tuple[object, int | None]] = {}
        self.shared_link: tuple[float, float] | None = None  # the shared store: (bytes/s, round trip s)
        self._landed = False  # a DRAM load just finished: the next prefill step is a restore's tail
        self._after_load: list[float] = []  # such steps' time over what the prefill model says
        self._requests: list[tuple[float, float]] = []  # (prompt tokens, s from arrival to first scheduling)

    # ---- learning from the engine --------------------------------------------------------------
    def observe_prefill(self, start: int, tokens: int, seconds: float, refit_every: int = 8) -> None:
        """One step that prefilled ``tokens`` tokens from ``start`` (and nothing else) took ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        landed, self._landed = self._landed, False
        if landed and self.prefill is not None and self._seen > self.WARMUP_STEPS:
            # the step right after a load (a restore's tail): not a sample of plain prefill, but what
            # the restore pays on top of it (on the CPU backend the load's copies slow it down)
            self._after_load.append(float(seconds / self.prefill.seconds(start, tokens)))
            del self._after_load[:-32]
            self._break_even.clear()
            return
        self._seen += 1
        if self._seen <= self.WARMUP_STEPS:
            return
        self._samples.append((int(start), int(tokens), float(seconds)))
        del self._samples[:-512]
        if len(self._samples) < self.MIN_SAMPLES:
            return
        # a fit is a few 3-column least squares: refit on every sample while there are few
        if self.prefill is None or len(self._samples) < 64 or len(self._samples) % refit_every == 0:
            fitted = PrefillModel.fit(self._samples)
            if fitted is not None:
                self.prefill = fitted

    def observe_load(self, nbytes: int, seconds: float) -> None:
        """A load job that moved ``nbytes`` from DRAM into HBM (no NVMe reads) took ``seconds`` in the
        mover: the live cost of a DRAM load (copy, decode, pacing to a capped link, job overhead).

        From the first such job the per-byte cost is the measured one (the job latency kept from the
        rates): the start-up measurement copies one large buffer, a load copies a block per layer at
        a time, and on the CPU backend it ran 5-10x slower than that measurement. Once the jobs
        span sizes (2x apart, ``MIN_SAMPLES`` of them) latency and rate are fitted together."""
        if nbytes <= 0 or seconds <= 0:
            return
        self._landed = True
        self._loads.append((float(nbytes), float(seconds)))
        del self._loads[:-256]
        data = np.asarray(self._loads)
        if len(self._loads) < self.MIN_SAMPLES or data[:, 0].max() < 2 * data[:, 0].min():
            # too few jobs, or one size only (latency and rate can't be told apart): the rate only
            latency = self.rates.job_latency_s
            per_byte = float(np.median(np.maximum(data[:, 1] - latency, 0.0) / data[:, 0]))
            if per_byte > 0:
                self.load_fit = (latency, per_byte)
                self._break_even.clear()
            return
        weight = 1.0 / np.maximum(data[:, 1], 1e-5)
        design = np.stack([np.ones(len(data)), data[:, 0]], axis=1)
        latency, per_byte = _nonnegative_lstsq(design * weight[:, None], data[:, 1] * weight)
        if per_byte > 0:
            self.load_fit = (float(latency), float(per_byte))
            self._break_even.clear()

    def refresh_rates(self, rates: LinkRates) -> None:
        """New link measurements (already capped)."""
        self.rates = rates
        self._break_even.clear()

    def set_shared_link(self, bps: float, rtt_s: float) -> None:
        """The shared store's measured link (``SharedStore.measure``)."""
        self.shared_link = (float(bps), float(rtt_s))

    # ---- predictions ---------------------------------------------------------------------------
    def fetch_seconds(self, blocks: int, nbytes: int) -> float:
        """Fetching ``blocks`` blocks (``nbytes`` as stored) from the shared store into DRAM, then
        loading them (one round trip: one pipeline)."""
        bps, rtt = self.shared_link or (1.25 * GB, 500e-6)  # unmeasured: 10 GbE
        return rtt + nbytes / bps + float(self.load_seconds(blocks, 0))

    def fetch_beats_recompute(self, start_tokens: int, blocks: int, nbytes: int) -> tuple[bool, float, float | None]:
        """(fetch?, predicted fetch s, predicted recompute s) for ``blocks`` blocks found in the
        shared store after ``start_tokens`` tokens. Fetches while no prefill model is fitted."""
        fetch = self.fetch_seconds(blocks, nbytes)
        recompute = self.recompute_seconds(start_tokens, blocks * self.block_tokens)
        return recompute is None or fetch < recompute, fetch, recompute

    def round_trip_seconds(self) -> float:
        """The engine step an asynchronous load adds to its request (``LinkRates.round_trip_s``)."""
        return self.rates.round_trip_s

    def after_load_factor(self) -> float:
        """How much longer the step right after a load (a restore's tail) runs than the prefill model
        predicts for its shape, measured (never below 1): the median of the last few, or, while there
        are fewer than five, the smallest (timing noise only ever adds: one step slowed by something
        else must not make every load look slow)."""
        samples = self._after_load
        if not samples:
            return 1.0
        return max(1.0, float(np.median(samples) if len(samples) >= 5 else min(samples)))

    def observe_request(self, tokens: int, seconds: float) -> None:
        """A request of ``tokens`` prompt tokens reached its first scheduling ``seconds`` after it
        arrived: vLLM's handling of it outside the engine steps (input processing, block hashes),
        which loads and recomputes pay alike, plus any queueing behind other requests."""
        if tokens > 0 and seconds >= 0:
            self._requests.append((float(tokens), float(seconds)))
            del self._requests[:-64]

    def request_seconds(self, tokens: int) -> float:
        """What a request of ``tokens`` tokens spends outside the engine steps before its first one:
        a rate per token (the lower quartile of the observed rates: queueing only ever adds). Not a
        term of any load decision (loading and recomputing pay it alike); it completes a TTFT."""
        rates = [s / t for t, s in self._requests if t >= 256]
        return float(np.percentile(rates, 25)) * tokens if rates else 0.0

    def restore_seconds(self, dram_blocks: int, nvme_blocks: int, prompt_tokens: int, computed_blocks: int = 0) -> \
            float | None:
        """The TTFT of a prompt of ``prompt_tokens`` whose first blocks are loaded (``dram_blocks``
        then ``nvme_blocks`` after ``computed_blocks`` vLLM already holds) and the rest recomputed."""
        if self.prefill is None:
            return None
        start = (computed_blocks + dram_blocks + nvme_blocks) * self.block_tokens
        tail = float(self.prefill.seconds(start, max(prompt_tokens - start, 0)))
        factor = self.after_load_factor() if dram_blocks + nvme_blocks > 0 else 1.0
        return float(self.load_seconds(dram_blocks, nvme_blocks)) + tail * factor + self.request_seconds(prompt_tokens)

    def load_seconds(self, dram_blocks: int | np.ndarray, nvme_blocks: int | np.ndarray) -> float | np.ndarray:
        rates = self.rates
        dram = np.asarray(dram_blocks, dtype=np.float64) * self.dram_block_bytes
        nvme = np.asarray(nvme_blocks, dtype=np.float64) * self.nvme_block_bytes
        link = 1 / rates.host_to_device_bps + (1 / rates.decode_bps if self.lossy and rates.decode_bps else 0)
        if self.load_fit is not None:  # measured on this engine's own DRAM loads, never faster than the
            latency, per_byte = self.load_fit  # link as last measured (a re-measurement or a cap that
            per_byte = max(per_byte, link)  # finds it slower counts at once)
        else:
            latency, per_byte = rates.job_latency_s, link
        t = (dram + nvme) * per_byte + nvme / rates.nvme_read_bps
        t = t + np.where(np.asarray(nvme_blocks) > 0, rates.nvme_latency_s, 0.0)
        fixed = latency + self.round_trip_seconds()
        t = np.where(np.asarray(dram_blocks) + np.asarray(nvme_blocks) > 0, t + fixed, 0.0)
        return float(t) if t.ndim == 0 else t

    def recompute_seconds(self, start_tokens: int, tokens: int) -> float | None:
        if self.prefill is None:
            return None
        return float(self.prefill.seconds(start_tokens, tokens))

    def best_split(self, computed_blocks: int, in_dram: Sequence[bool], prompt_tokens: int) -> Split | None:
        """Load the first ``k`` blocks of a hit (``in_dram``: where each is), recompute from there to
        the end of the prompt; the ``k`` that minimizes the sum. None without a prefill model."""
        if self.prefill is None:
            return None
        bt = self.block_tokens
        flags = np.asarray(in_dram, dtype=bool)
        k = np.arange(len(flags) + 1)
        dram = np.concatenate([[0], np.cumsum(flags)])
        load = self.load_seconds(dram, k - dram)
        start = (computed_blocks + k) * bt
        recompute = self.prefill.seconds(start, np.maximum(prompt_tokens - start, 0))
        recompute = np.where(k > 0, recompute * self.after_load_factor(), recompute)  # the tail after a load
        total = load + recompute
        best = int(np.argmin(total))
        if total[-1] <= total[best] * (1 + self.margin):  # loading all unless clearly slower: a
            best = len(flags)  # loaded prefix also spares the GPU, and the model has errors
        return Split(best, len(flags), float(load[best]), float(recompute[best]), float(total[-1]), float(total[0]))

    def split_for(self, computed_blocks: int, dram_blocks: int, hit_blocks: int, prompt_tokens: int,
                  in_dram: Sequence[bool] = ()) -> Split | None:
        """``best_split`` from counts: without per-block tiers the DRAM blocks are taken to come first
        (write-through keeps a prefix's front in DRAM longest); the prompt ends no earlier than the hit."""
        flags = tuple(in_dram) or (True,) * dram_blocks + (False,) * (hit_blocks - dram_blocks)
        end = (computed_blocks + hit_blocks) * self.block_tokens
        return self.best_split(computed_blocks, flags, max(prompt_tokens, end))

    def restore_beats_recompute(self, tokens: int, from_nvme: bool = True) -> bool | None:
        """Will a session of ``tokens`` tokens load faster than it recomputes? (None: no model yet.)"""
        if self.prefill is None:
            return None
        blocks = tokens // self.block_tokens
        load = self.load_seconds(0, blocks) if from_nvme else self.load_seconds(blocks, 0)
        return load < self.prefill.seconds(0, blocks * self.block_tokens)

    def break_even_tokens(self, from_nvme: bool, limit: int = 1 << 21) -> int | None:
        """Smallest prompt for which loading it beats recomputing it (None: never, up to ``limit``;
        also None without a prefill model). Cached until the model or the rates change."""
        if self.prefill is None:
            return None
        cached = self._break_even.get(from_nvme)
        if cached is not None and cached[0] is self.prefill:
            return cached[1]
        tokens = np.arange(1, limit // self.block_tokens + 1) * self.block_tokens
        blocks = tokens // self.block_tokens
        load = self.load_seconds(0, blocks) if from_nvme else self.load_seconds(blocks, 0)
        wins = np.nonzero(load < self.prefill.seconds(0, tokens))[0]
        found = int(tokens[wins[0]]) if len(wins) else None
        self._break_even[from_nvme] = (self.prefill, found)
        return found

    def report(self) -> dict:
        r = self.rates
        return {"host_to_device_gbps": r.host_to_device_bps / GB, "nvme_read_gbps": r.nvme_read_bps / GB,
                "round_trip_ms": self.round_trip_seconds() * 1e3, "after_load_factor": self.after_load_factor(),
                "request_us_per_token": self.request_seconds(1_000_000),
                "sources": dict(r.source),
                "dram_load": None if self.load_fit is None else {
                    "job_latency_ms": self.load_fit[0] * 1e3, "gbps": 1 / self.load_fit[1] / GB,
                    "samples": len(self._loads)},
                "prefill": None if self.prefill is None else {
                    "overhead_ms": self.prefill.overhead_s * 1e3, "per_token_us": self.prefill.per_token_s * 1e6,
                    "attention_ns_per_token_pair": self.prefill.attention_s * 1e9, "points": self.prefill.points},
                "break_even_tokens": {"dram": self.break_even_tokens(False), "nvme": self.break_even_tokens(True)},
                "shared": None if self.shared_link is None else {
                    "gbps": self.shared_link[0] / GB, "rtt_ms": self.shared_link[1] * 1e3}}


# ---- measurements --------------------------------------------------------------------------------
CPU_PIECE_BYTES = 64 << 10  # a CPU load copies one block of one layer at a time (tiny model: 64 KiB)


def measure_copy_bps(nbytes: int = 64 << 20, reps: int = 3) -> tuple[float, str]:
    """Host->device bandwidth: a pinned copy to the GPU where there is one, else DRAM copies in
    pieces of ``CPU_PIECE_BYTES`` (on CPU, "loading" copies a block of a layer at a time from
    kvtier's pool into vLLM's KV cache, each copy one call: one large memcpy measured 5-10x the
    rate those loads reach on the CPU dev box, and the load term under-predicted short restores)."""
    import torch

    if torch.cuda.is_available():
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return nbytes / best, "pinned host->device copy (CUDA)"
    pieces = max(nbytes // CPU_PIECE_BYTES, 1)
    src = np.ones((pieces, CPU_PIECE_BYTES), dtype=np.uint8)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(reps):  # one memcpy a piece on this thread (torch's copy would wake its OpenMP
        start = time.perf_counter()  # pool for each piece: on a busy box that wait, not the copy, is timed)
        for i in range(pieces):
            np.copyto(dst[i], src[i])
        best = min(best, time.perf_counter() - start)
    return pieces * CPU_PIECE_BYTES / best, f"DRAM copies of {CPU_PIECE_BYTES >> 10} KiB pieces (no GPU)"


def measure_nvme_read_bps(directory: str | os.PathLike, nbytes: int = 64 << 20, chunk: int = 2 << 20) -> tuple[float,
                                                                                                               str]:
    """Sequential direct-IO reads of a scratch file in ``directory`` (the NVMe tier's own IO size)."""
    from kvtier.tiers.nvme.rawio import RawDirectIO

    raw = RawDirectIO(Path(directory), nbytes, chunk)
    try:
        raw.write()
        best = min(raw.read() for _ in range(2))
    finally:
        raw.close()
    how = "O_DIRECT" if raw.direct else "buffered (no O_DIRECT), page cache dropped"
    return nbytes / best, f"sequential {chunk >> 20} MiB reads, {how}"


def measure_rates(nvme_dir: str | os.PathLike | None, caps: dict[str, float] | None = None,
                  quick: bool = False) -> LinkRates:
    size = (16 if quick else 64) << 20
    h2d, h2d_how = measure_copy_bps(size)
    source = {"host_to_device_bps": h2d_how}
    nvme = DEFAULT_RATES.nvme_read_bps
    # several drives (``"/a:/b"``): a restore reads from all at once, so their rates add up; two
    # directories on one filesystem are one disk, measured once
    drives = {os.stat(d).st_dev: d for d in str(nvme_dir or "").split(os.pathsep) if d and Path(d).is_dir()}
    if drives:
        measured = [measure_nvme_read_bps(d, size) for d in drives.values()]
        nvme = sum(bps for bps, _how in measured)
        source["nvme_read_bps"] = measured[0][1] + (f", {len(measured)} drives summed" if len(measured) > 1 else "")
    else:
        source["nvme_read_bps"] = "default (no NVMe directory)"
    return LinkRates(h2d, nvme, source=source).capped(caps or {})
