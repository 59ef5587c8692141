"""``python -m benchmarks scale``: how the costs grow with the work. Every figure must grow at most linearly
with what it handles (a per-block or per-session cost that stays flat).

1. **The NVMe tier at 10k, 100k and 1M blocks** (``--quick``: 10k, 100k, 200k). Records carry one
   4 KiB page of payload behind their header page (8 KiB on disk each), written through the store's
   own group commits (``NvmeStore.write_batch``, buffered IO), with a session catalog naming them in
   sessions of 64 blocks; building them is not timed. Each size is measured in three fresh processes,
   the shard's page cache dropped before each; each timing is the lowest of the three (this box's speed
   changes from one process to the next by up to 2x, idle or not):

   * start-up: ``NvmeStore(...)`` on the directory (journal replay, the entries checked against the
     segments, the locator) plus opening the session catalog: ``startup_s_per_million_blocks`` at the
     largest size. The scheduler half's start (the read-only scan and ``TierManager`` indexing every
     block and reading the catalog back, as ``kvtier serve`` does) is timed as well
     (``server_startup_s_per_million_blocks``: both halves);
   * memory: RSS after both halves started minus RSS of the same process with both started on an
     empty directory, per block (``ram_bytes_per_block_1m``): the locator, the planner's index, the
     catalog's sessions;
   * a 1,024-block prefix lookup through ``BlockTable.lookup`` (recency and policy updates included),
     a different chain each time, so the index is not all in the CPU's cache (``lookup_1m_vs_10k``:
     the median of 1,001 at the largest size / at 10k, each size in its own processes; the same chain again, as
     ``kvtier bench tiers`` measures it, is ``_lookup_hot_1m_vs_10k``; a 10k-block manager taking
     turns with the largest in its process, ``_lookup_1m_vs_10k_same_process``);
   * demotion planning: ``BlockTable.victims(NVME)`` (every NVMe block put in eviction order), per
     block, largest size against 10k;
   * journal compaction: ``Journal.rewrite`` of every live entry (what start-up does when the journal
     holds more than twice the live entries), seconds per million blocks.
2. **Session catalogs of 10k, 100k and 1M sessions** (``--quick``: 200k the largest): a new process
   opens the catalog and builds the tier manager reading it back, page cache dropped; the lowest of three.
3. **``kvtier sessions --json`` with 100k sessions**, end to end in a new process, against a real
   admin socket over an in-process tier engine (``python -m benchmarks top``'s server,
   ``benchmarks.top.demo_admin``: a thread re-records some sessions every 0.2 s); median of three.
4. **``kvtier top`` with 100k sessions**, against the same server: its CPU at a 1 s refresh, as
   ``python -m benchmarks top`` measures it (60 s; ``--quick``: 15 s), without that bench's key-latency part
   (at 100k sessions on a loaded box it once timed out waiting for the help page, likely its escape and
   next key read as one alt-key). The server's CPU meanwhile is reported too.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

__all__ = ["SCALE_KEYS", "run_scale_bench", "build_store", "measure_store", "build_catalog", "measure_catalog",
           "sessions_json_seconds", "summarize", "block_key", "bench_fingerprint"]

SCALE_KEYS = (
    "startup_s_per_million_blocks",
    "ram_bytes_per_block_1m",
    "lookup_1m_vs_10k",
    "sessions_json_s_100k",
    "top_cpu_percent_100k",
    "server_startup_s_per_million_blocks",
    "startup_per_block_1m_vs_10k",
    "victims_us_per_block_1m_vs_10k",
    "journal_compact_s_per_million_blocks",
    "catalog_open_s_1m",
    "catalog_open_1m_vs_100k_per_session",
    "largest_blocks",
    "largest_catalog_sessions",
)
BLOCK_SIZES = (10_000, 100_000, 1_000_000)
QUICK_BLOCK_SIZES = (10_000, 100_000, 200_000)
CATALOG_SIZES = (10_000, 100_000, 1_000_000)
QUICK_CATALOG_SIZES = (10_000, 100_000, 200_000)
SERVED_SESSIONS = 100_000
PAYLOAD = 4096  # one page of payload: each record is its header page plus this, 8 KiB on disk
SESSION_BLOCKS = 64  # blocks per session of the NVMe run's catalog (1,024-token prompts)
CATALOG_BLOCKS = 4  # blocks per session of the catalog runs
CHAIN = 1024  # blocks per prefix lookup
WRITE_BATCH = 16_384  # blocks per write_batch (a multiple of SESSION_BLOCKS)
DRAM_BYTES = 1 << 20


def bench_fingerprint():
    from kvtier.layout import KVGeometry, ModelFingerprint

    return ModelFingerprint("bench-scale", KVGeometry(1, 1, 64, 16))  # 4 KiB blocks of 16 tokens


def block_key(i: int) -> bytes:
    """The ``i``-th block's key: 32 bytes, as vLLM's block hashes."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def _capacity(blocks: int) -> int:
    from kvtier.tiers.records import file_bytes_for

    return 2 * blocks * file_bytes_for(PAYLOAD) + (1 << 30)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


# ---- the NVMe tier ------------------------------------------------------------------------------
def build_store(root: Path, blocks: int) -> None:
    """``blocks`` records (keys ``block_key(0..blocks-1)``) written through the store's group commits,
    and the session catalog naming them, ``SESSION_BLOCKS`` a session."""
    from kvtier.persist.catalog import Catalog, SessionRecord, encode_tokens
    from kvtier.plan.index import namespace_of
    from kvtier.tiers.nvme.store import NvmeStore

    fingerprint = bench_fingerprint()
    namespace = namespace_of(fingerprint.digest)
    block_tokens = fingerprint.geometry.block_tokens
    payload = bytearray(os.urandom(PAYLOAD))
    store = NvmeStore(root, _capacity(blocks), io_threads=2, direct="off")
    catalog = Catalog(root, fingerprint)
    now = time.time()
    try:
        for first in range(0, blocks, WRITE_BATCH):
            keys = [block_key(i) for i in range(first, min(blocks, first + WRITE_BATCH))]
            outcomes = store.write_batch([(namespace, key, payload, "none") for key in keys], fingerprint.digest)
            failed = [o for o in outcomes if not isinstance(o, int)]
            if failed:
                raise RuntimeError(f"building the NVMe tier failed: {failed[0]}")
            sessions = []
            for start in range(0, len(keys), SESSION_BLOCKS):
                n = (first + start) // SESSION_BLOCKS
                chunk = keys[start : start + SESSION_BLOCKS]
                tokens = len(chunk) * block_tokens
                sessions.append(SessionRecord(f"s-{n}", namespace, b"".join(chunk), 32, tokens, None, now, now + n,
                                              encode_tokens(range(n * tokens, (n + 1) * tokens))))
            catalog.write(sessions)
    finally:
        catalog.close()
        store.close()


def _start(directory: Path, capacity: int) -> tuple:
    """Both halves' start on ``directory``: the worker's store and the catalog, then the scheduler's
    scan and tier manager. Returns (store, catalog, manager, seconds of each step, RSS after each)."""
    import gc

    from kvtier.persist.catalog import Catalog
    from kvtier.plan.manager import TierManager
    from kvtier.tiers.nvme.drives import scan_drives
    from kvtier.tiers.nvme.store import NvmeStore

    fingerprint = bench_fingerprint()
    rss = {"before": _rss()}
    started = time.perf_counter()
    store = NvmeStore(directory, capacity)  # as the worker opens it (8 IO threads, direct IO where it works)
    seconds = {"store_s": time.perf_counter() - started}
    rss["store"] = _rss()
    started = time.perf_counter()
    catalog = Catalog(directory, fingerprint)
    seconds["catalog_s"] = time.perf_counter() - started
    started = time.perf_counter()
    records, removed = scan_drives(directory, capacity, 1)  # as the scheduler half (plugins/vllm/scheduler.py)
    seconds["scan_s"] = time.perf_counter() - started
    started = time.perf_counter()
    manager = TierManager(fingerprint, DRAM_BYTES, capacity, nvme_records=records, nvme_removed_at_start=removed,
                          catalog=catalog)
    seconds["index_s"] = time.perf_counter() - started
    del records
    gc.collect()
    rss["all"] = _rss()
    return store, catalog, manager, seconds, rss


def _reference_manager(blocks: int):
    """A tier manager indexing ``blocks`` NVMe blocks (keys ``block_key(0..blocks-1)``), as its start
    from a scan of them would: the small side of a same-process comparison."""
    from kvtier.plan.index import namespace_of
    from kvtier.plan.manager import TierManager
    from kvtier.tiers.nvme.store import BlockRecord

    fingerprint = bench_fingerprint()
    namespace = namespace_of(fingerprint.digest)
    records = [BlockRecord(namespace, block_key(i), PAYLOAD) for i in range(blocks)]
    return TierManager(fingerprint, DRAM_BYTES, _capacity(blocks), nvme_records=records)


def _interleaved(sides: list[tuple[object, int]], reps: int, rng: random.Random) -> tuple[list, list]:
    """Per side ``(manager, blocks)``: the seconds of ``reps`` prefix lookups, each of a different
    chain, and of ``victims(NVME)`` (a fifth as many), the sides taking turns (order alternating)."""
    from kvtier.plan.index import Tier, namespace_of

    namespace = namespace_of(bench_fingerprint().digest)
    chain = min([CHAIN, *(blocks for _m, blocks in sides)])
    lookups: list[list[float]] = [[] for _ in sides]
    victims: list[list[float]] = [[] for _ in sides]
    for rep in range(reps):
        order = list(range(len(sides)))[:: -1 if rep % 2 else 1]
        for k in order:
            manager, blocks = sides[k]
            first = rng.randrange(0, blocks - chain + 1)
            keys = [block_key(i) for i in range(first, first + chain)]
            started = time.perf_counter()
            rows = manager.table.lookup(namespace, keys)
            lookups[k].append(time.perf_counter() - started)
            if len(rows) != chain:
                raise RuntimeError(f"a {chain}-block chain found {len(rows)} of its blocks")
        if rep % 5 == 0:
            for k in order:
                started = time.perf_counter()
                found = len(sides[k][0].table.victims(Tier.NVME))
                victims[k].append(time.perf_counter() - started)
                if found != sides[k][1]:
                    raise RuntimeError(f"victims() ordered {found} of {sides[k][1]} blocks")
    return lookups, victims


def _paired(samples: list[float], references: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(samples, references))


def measure_store(root: Path, blocks: int, empty: Path, lookups: int = 1001, compactions: int = 3,
                  reference: int = 10_000, seed: int = 0) -> dict:
    """Start-up, memory, lookups, victims and journal compaction on the tier ``build_store`` made
    under ``root``, in this process (``empty``: an empty directory for the memory baseline). With
    ``reference`` smaller than ``blocks``, lookups and victims also run on a tier manager of
    ``reference`` blocks in the same process, taking turns with this one: the ratios
    ``lookup_vs_reference`` and ``victims_per_block_vs_reference`` (this box is shared and noisy)."""
    from kvtier.plan.index import Tier, namespace_of

    capacity = _capacity(blocks)
    namespace = namespace_of(bench_fingerprint().digest)
    empty.mkdir(parents=True, exist_ok=True)
    base = _start(empty, capacity)  # imports, threads and buffers: what an empty tier costs
    rss_empty = base[4]
    base[0].close()
    base[1].close()
    del base
    store, catalog, manager, seconds, rss = _start(root, capacity)
    try:
        found, indexed = len(store.locator), len(manager.table.index)
        sides = [(manager, blocks)]
        if reference < blocks:  # built after every RSS figure was taken
            sides.append((_reference_manager(reference), reference))
        cold, victims = _interleaved(sides, lookups, random.Random(seed))
        chain = min(CHAIN, blocks)
        keys = [block_key(i) for i in range((blocks - chain) // 2, (blocks - chain) // 2 + chain)]
        hot = []
        for _ in range(201):  # the same chain again and again (kvtier bench tiers)
            started = time.perf_counter()
            manager.table.lookup(namespace, keys)
            hot.append(time.perf_counter() - started)
        journal = store.locator.journal
        compact = []
        for _ in range(compactions):
            started = time.perf_counter()
            journal.rewrite(store.locator.journaled())
            compact.append(time.perf_counter() - started)
        out = {"blocks": blocks, "found": found, "indexed": indexed, "victims": len(manager.table.victims(Tier.NVME)),
               "sessions": len(manager.table.sessions), "removed": store.removed_at_scan, **seconds,
               "startup_s": seconds["store_s"] + seconds["catalog_s"], "server_startup_s": sum(seconds.values()),
               "ram_bytes_per_block": (rss["all"] - rss_empty["all"]) / blocks,
               # the worker's part (the store: its locator); the rest is the scheduler's (index, sessions)
               "store_bytes_per_block": (rss["store"] - rss["before"] - rss_empty["store"]
                                         + rss_empty["before"]) / blocks,
               "index_bytes_per_block": manager.table.index.memory_bytes() / blocks,
               "lookup_s": statistics.median(cold[0]), "lookup_hot_s": statistics.median(hot),
               "victims_s": statistics.median(victims[0]), "compact_s": statistics.median(compact),
               "journal_bytes": journal.path.stat().st_size}
        if len(sides) > 1:
            out.update({"reference_blocks": reference, "lookup_reference_s": statistics.median(cold[1]),
                        "lookup_vs_reference": _paired(cold[0], cold[1]),
                        "victims_per_block_vs_reference": _paired(victims[0], victims[1]) * reference / blocks})
        return out
    finally:
        store.close()
        catalog.close()


# ---- session catalogs ---------------------------------------------------------------------------
def build_catalog(directory: Path, sessions: int) -> None:
    """A catalog of ``sessions`` sessions, ``CATALOG_BLOCKS`` keys and their token ids each."""
    from kvtier.persist.catalog import Catalog, SessionRecord, encode_tokens
    from kvtier.plan.index import namespace_of

    fingerprint = bench_fingerprint()
    namespace = namespace_of(fingerprint.digest)
    tokens = CATALOG_BLOCKS * fingerprint.geometry.block_tokens
    token_ids = encode_tokens(range(tokens))
    catalog = Catalog(directory, fingerprint)
    now = time.time()
    try:
        for first in range(0, sessions, 10_000):
            catalog.write([SessionRecord(f"agent-{i}", namespace, os.urandom(32 * CATALOG_BLOCKS), 32, tokens, None,
                                         now, now + i, token_ids) for i in range(first, min(sessions, first + 10_000))])
    finally:
        catalog.close()


def measure_catalog(directory: Path) -> dict:
    """A restart's read of the catalog under ``directory``: opening it and building the tier manager
    that reads every session back (in this process)."""
    from kvtier.persist.catalog import Catalog
    from kvtier.plan.manager import TierManager

    fingerprint = bench_fingerprint()
    rss = _rss()
    started = time.perf_counter()
    catalog = Catalog(directory, fingerprint)
    manager = TierManager(fingerprint, DRAM_BYTES, catalog=catalog)
    elapsed = time.perf_counter() - started
    try:
        return {"open_s": elapsed, "sessions": len(manager.table.sessions), "bad_rows": catalog.bad_rows,
                "ram_bytes_per_session": (_rss() - rss) / max(1, len(manager.table.sessions))}
    finally:
        catalog.close()


# ---- fresh processes ----------------------------------------------------------------------------
def _in_child(function: str, *args: object) -> dict:
    """``function(*args)`` of this module in a new process (start-up and RSS are the whole process's)."""
    code = ("import json, sys\nfrom pathlib import Path\nimport benchmarks.scale as scale\n"
            "args = json.loads(sys.argv[1])\n"
            f"out = scale.{function}(*[Path(a) if isinstance(a, str) else a for a in args])\n"
            "print(json.dumps(out))\n")
    answer = subprocess.run([sys.executable, "-c", code, json.dumps([str(a) if isinstance(a, Path) else a
                                                                    for a in args])],
                            capture_output=True, text=True)
    if answer.returncode != 0:
        raise RuntimeError(f"{function} failed in its process:\n{answer.stderr[-3000:]}")
    return json.loads(answer.stdout.strip().splitlines()[-1])


def _drop_cache(directory: Path) -> None:
    from kvtier.tiers.nvme.rawio import drop_page_cache

    drop_page_cache(directory)


# timings of ``measure_store``: the lowest of its processes counts (the box's speed changes from one
# process to the next by up to 2x, idle or not); the same-process ratios take the median
TIMED = ("store_s", "catalog_s", "scan_s", "index_s", "startup_s", "server_startup_s", "lookup_s", "lookup_hot_s",
         "lookup_reference_s", "victims_s", "compact_s")
PAIRED = ("lookup_vs_reference", "victims_per_block_vs_reference")


def combine(runs: list[dict]) -> dict:
    """One size's ``measure_store`` answers from several processes: each timing the lowest, each
    same-process ratio the median, the rest (counts, memory) the first process's."""
    out = dict(runs[0])
    for key in TIMED:
        if key in out:
            out[key] = min(run[key] for run in runs)
    for key in PAIRED:
        if key in out:
            out[key] = statistics.median(run[key] for run in runs)
    out["processes"] = len(runs)
    return out


def nvme_figures(base: Path, sizes: tuple[int, ...], progress: Callable[[str], None],
                 processes: int = 3) -> dict[int, dict]:
    out = {}
    for blocks in sizes:
        root = base / f"nvme-{blocks}"
        progress(f"NVMe tier: writing {blocks:,} records of 8 KiB ({blocks * 8 / 2**20:.1f} GiB; not timed)")
        started = time.perf_counter()
        build_store(root, blocks)
        built = time.perf_counter() - started
        progress(f"NVMe tier: start-up, memory, lookups, victims, compaction at {blocks:,} blocks "
                 f"({processes} new processes)")
        runs = []
        try:
            for n in range(processes):
                _drop_cache(root)
                runs.append(_in_child("measure_store", root, blocks, base / f"empty-{blocks}-{n}", 1001, 3,
                                      sizes[0]))
        finally:
            shutil.rmtree(root, ignore_errors=True)
            for n in range(processes):
                shutil.rmtree(base / f"empty-{blocks}-{n}", ignore_errors=True)
        got = out[blocks] = {**combine(runs), "build_s": built}
        if any(run["found"] != blocks or run["indexed"] != blocks for run in runs):
            raise RuntimeError(f"the NVMe tier re-opened with {got['found']:,} of {blocks:,} blocks "
                               f"({got['indexed']:,} indexed)")
        progress(f"  start-up {got['startup_s']:.2f} s (store {got['store_s']:.2f}, catalog {got['catalog_s']:.2f}; "
                 f"scan {got['scan_s']:.2f}, index {got['index_s']:.2f}), {got['ram_bytes_per_block']:.0f} B/block, "
                 f"lookup {got['lookup_s'] * 1e3:.2f} ms (lowest of {processes})")
    return out


def catalog_figures(base: Path, sizes: tuple[int, ...], progress: Callable[[str], None], runs: int = 3) -> dict:
    out = {}
    for sessions in sizes:
        directory = base / f"catalog-{sessions}"
        progress(f"session catalog: writing {sessions:,} sessions (not timed)")
        build_catalog(directory, sessions)
        samples = []
        try:
            for _ in range(runs):
                _drop_cache(directory)
                samples.append(_in_child("measure_catalog", directory))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        samples.sort(key=lambda s: s["open_s"])
        out[sessions] = {**samples[0], "runs_s": [s["open_s"] for s in samples]}
        if any(sample["sessions"] != sessions for sample in samples):
            raise RuntimeError(f"the catalog read back {out[sessions]['sessions']:,} of {sessions:,} sessions")
        progress(f"  opened in {out[sessions]['open_s']:.2f} s (lowest of {runs} processes)")
    return out


def sessions_json_seconds(socket: Path, sessions: int, runs: int = 3) -> dict:
    """``kvtier sessions --json`` end to end (a new process each time) against the admin server on
    ``socket``, which holds ``sessions`` sessions; the median of ``runs``, and ``--help``'s time (the
    CLI's own start, the floor under it)."""
    command = [sys.executable, "-m", "kvtier.cli.main", "sessions", "--json", "--socket", str(socket)]
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        answer = subprocess.run(command, capture_output=True, text=True, timeout=300)
        samples.append(time.perf_counter() - started)
        if answer.returncode != 0:
            raise RuntimeError(f"kvtier sessions --json failed: {answer.stderr[-2000:]}")
        doc = json.loads(answer.stdout)
        if doc["total"] != sessions:
            raise RuntimeError(f"kvtier sessions --json listed {doc['total']} of {sessions} sessions")
    started = time.perf_counter()
    subprocess.run([*command[:4], "--help"], capture_output=True, check=True, timeout=300)
    return {"seconds": statistics.median(samples), "runs_s": samples, "rows": len(doc["sessions"]),
            "help_s": time.perf_counter() - started}


def top_cpu_percent(socket: Path, seconds: float) -> dict:
    """``kvtier top``'s CPU (all its threads) at a 1 s refresh over ``seconds``, as a percentage of
    one core: ``python -m benchmarks top``'s measurement (a child on a 120x40 pseudo-terminal, 3 s of warm-up
    first), without its key-latency part. Also this process's CPU meanwhile: the admin server
    answering top's polls (and the churn thread)."""
    import psutil

    from benchmarks.top import PtyApp

    app = PtyApp(["--socket", str(socket), "--interval", "1"])
    try:
        if not app.read_until(b"session-", 120):
            raise RuntimeError("kvtier top did not draw its sessions table:\n"
                               + app.seen[-2000:].decode("utf-8", "replace"))
        app.drain(3.0)  # startup (imports, first layout) is not the steady state
        child, server = psutil.Process(app.proc.pid), psutil.Process()
        before, served, start = child.cpu_times(), server.cpu_times(), time.monotonic()
        app.drain(seconds)
        after, served_after, elapsed = child.cpu_times(), server.cpu_times(), time.monotonic() - start
    finally:
        code = app.close()
    return {"cpu_percent_one_core": (after.user + after.system - before.user - before.system) / elapsed * 100,
            "server_cpu_percent": (served_after.user + served_after.system - served.user - served.system)
            / elapsed * 100, "seconds": seconds, "exit_code": code}


def served_figures(sessions: int, top_seconds: float, progress: Callable[[str], None] = print,
                   runs: int = 3) -> tuple[dict, dict | None]:
    """``kvtier sessions --json`` (``sessions_json_seconds``) and, with ``top_seconds``, ``kvtier top``
    (``top_cpu_percent``) against one real admin socket over an in-process tier engine holding
    ``sessions`` sessions, a thread re-recording some of them every 0.2 s (``python -m benchmarks top``'s
    server). Its socket lives in a short temp dir (a Unix socket's path is limited)."""
    from benchmarks.top import demo_admin

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-scale-") as tmp:
        progress(f"an admin server with {sessions:,} sessions (building it is not timed)")
        admin, engine = demo_admin(Path(tmp), sessions)
        socket = Path(tmp) / "admin.sock"
        try:
            progress(f"kvtier sessions --json against it, {runs} times")
            listed = sessions_json_seconds(socket, sessions, runs)
            top = None
            if top_seconds:
                progress(f"CPU of kvtier top at a 1 s refresh with {sessions:,} sessions, for {top_seconds:.0f} s")
                top = top_cpu_percent(socket, top_seconds)
        finally:
            admin.stop_churn.set()
            admin.stop()
            engine.close(write_back=False)
    return listed, top


# ---- the figures --------------------------------------------------------------------------------
def _label(n: int) -> str:
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1000}k" if n % 1000 == 0 else str(n)


def summarize(nvme: dict[int, dict], catalogs: dict[int, dict], sessions_json: dict | None,
              top: dict | None) -> dict:
    """The figures (``SCALE_KEYS`` and context) from each part's measurements by size: the largest
    size against the smallest (NVMe) or against the middle one (catalogs)."""
    # Ratios of sizes come from separate processes, each holding only its own tier (as a server of that
    # size would: a 10k-block index stays in the CPU's caches). The largest size's process also runs
    # lookups and victims on a 10k-block manager, taking turns with its own ("_same_process"): less
    # exposed to the box's load, but that small index then shares the caches with the large one.
    sizes, counts = sorted(nvme), sorted(catalogs)
    big, small = nvme[sizes[-1]], nvme[sizes[0]]
    per_million = 1e6 / sizes[-1]
    per_block = {n: nvme[n]["victims_s"] / n for n in sizes}
    reference = counts[-2] if len(counts) > 1 else counts[0]
    paired = big.get("reference_blocks") == sizes[0]  # the smallest size measured in the largest's process
    out = {
        "startup_s_per_million_blocks": big["startup_s"] * per_million,
        "ram_bytes_per_block_1m": big["ram_bytes_per_block"],
        "lookup_1m_vs_10k": big["lookup_s"] / small["lookup_s"],
        "sessions_json_s_100k": sessions_json["seconds"] if sessions_json else None,
        "top_cpu_percent_100k": top["cpu_percent_one_core"] if top else None,
        "server_startup_s_per_million_blocks": big["server_startup_s"] * per_million,
        "startup_per_block_1m_vs_10k": (big["startup_s"] / sizes[-1]) / (small["startup_s"] / sizes[0]),
        "victims_us_per_block_1m_vs_10k": per_block[sizes[-1]] / per_block[sizes[0]],
        "journal_compact_s_per_million_blocks": big["compact_s"] * per_million,
        "catalog_open_s_1m": catalogs[counts[-1]]["open_s"],
        "catalog_open_1m_vs_100k_per_session": (catalogs[counts[-1]]["open_s"] / counts[-1])
        / (catalogs[reference]["open_s"] / reference),
        "largest_blocks": sizes[-1],
        "largest_catalog_sessions": counts[-1],
    }

    def by_size(values: dict[int, float], fmt: str) -> str:
        return ", ".join(f"{_label(n)}: {format(v, fmt)}" for n, v in sorted(values.items()))

    out.update({
        "_block_sizes": by_size({n: n for n in sizes}, ","),
        "_startup_s": by_size({n: nvme[n]["startup_s"] for n in sizes}, ".3f"),
        "_store_open_s": by_size({n: nvme[n]["store_s"] for n in sizes}, ".3f"),
        "_catalog_of_blocks_open_s": by_size({n: nvme[n]["catalog_s"] for n in sizes}, ".3f"),
        "_scan_s": by_size({n: nvme[n]["scan_s"] for n in sizes}, ".3f"),
        "_index_build_s": by_size({n: nvme[n]["index_s"] for n in sizes}, ".3f"),
        "_ram_bytes_per_block": by_size({n: nvme[n]["ram_bytes_per_block"] for n in sizes}, ".0f"),
        "_store_bytes_per_block": by_size({n: nvme[n]["store_bytes_per_block"] for n in sizes}, ".0f"),
        "_index_bytes_per_block": by_size({n: nvme[n]["index_bytes_per_block"] for n in sizes}, ".0f"),
        "_lookup_ms": by_size({n: nvme[n]["lookup_s"] * 1e3 for n in sizes}, ".3f"),
        "_lookup_hot_ms": by_size({n: nvme[n]["lookup_hot_s"] * 1e3 for n in sizes}, ".3f"),
        "_lookup_hot_1m_vs_10k": big["lookup_hot_s"] / small["lookup_hot_s"],
        "_victims_ms": by_size({n: nvme[n]["victims_s"] * 1e3 for n in sizes}, ".3f"),
        "_journal_compact_s": by_size({n: nvme[n]["compact_s"] for n in sizes}, ".3f"),
        "_journal_mib": by_size({n: nvme[n]["journal_bytes"] / 2**20 for n in sizes}, ".1f"),
        "_build_s": by_size({n: nvme[n].get("build_s", 0.0) for n in sizes}, ".1f"),
        "_catalog_sizes": by_size({n: n for n in counts}, ","),
        "_catalog_open_s": by_size({n: catalogs[n]["open_s"] for n in counts}, ".3f"),
        "_catalog_ram_bytes_per_session": by_size({n: catalogs[n]["ram_bytes_per_session"] for n in counts}, ".0f"),
    })
    if paired:
        out["_lookup_1m_vs_10k_same_process"] = big["lookup_vs_reference"]
        out["_victims_per_block_1m_vs_10k_same_process"] = big["victims_per_block_vs_reference"]
    if sessions_json:
        out["_sessions_json_runs_s"] = ", ".join(f"{s:.2f}" for s in sessions_json["runs_s"])
        out["_sessions_help_s"] = sessions_json["help_s"]
        out["_sessions_json_rows"] = sessions_json["rows"]
    if top:
        out["_top_seconds"] = top["seconds"]
        out["_server_cpu_percent_while_top"] = top["server_cpu_percent"]
    return out


def _check_room(base: Path, sizes: tuple[int, ...], counts: tuple[int, ...]) -> None:
    from kvtier.errors import UsageError
    from kvtier.tiers.records import file_bytes_for

    need = max(sizes) * file_bytes_for(PAYLOAD) * 1.2 + max(counts) * 600 + (2 << 30)
    free = shutil.disk_usage(base).free
    if free < need:
        raise UsageError(f"{base} has {free / 2**30:.1f} GiB free; this run needs about {need / 2**30:.1f} GiB",
                         hint="pass --dir on a disk with more room, or use --quick")


def run_scale_bench(quick: bool = False, progress: Callable[[str], None] = print, directory: str | None = None,
                    sessions: int = SERVED_SESSIONS) -> dict:
    """Every part; ``quick``: 200k blocks and sessions the largest sizes (a few minutes)."""
    sizes = QUICK_BLOCK_SIZES if quick else BLOCK_SIZES
    counts = QUICK_CATALOG_SIZES if quick else CATALOG_SIZES
    base = Path(directory) if directory else Path.cwd()
    _check_room(base, sizes, counts)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-scale-", dir=base) as tmp:
        nvme = nvme_figures(Path(tmp), sizes, progress)
        catalogs = catalog_figures(Path(tmp), counts, progress)
    sessions_json, top = served_figures(sessions, 15.0 if quick else 60.0, progress)
    results = summarize(nvme, catalogs, sessions_json, top)
    for key, value in results.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise RuntimeError(f"{key} came out {value}")
    results.update({"_quick": quick, "_served_sessions": sessions, "_wall_s": time.perf_counter() - started})
    return results
