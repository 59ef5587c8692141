"""``python -m benchmarks scale``'s building blocks at tiny sizes: the tier it builds re-opens with every
block indexed, catalogs read back whole, the figures come out positive and finite under every key,
and the sessions page the admin API answers (ordered on columns, only its rows built) is the one a
full sort of every row gives. No timing asserts: this box is shared."""
from __future__ import annotations

import math
import random

import pytest

from benchmarks import scale
from kvtier.tiers.nvme.journal import ENTRY_BYTES


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_the_built_tier_reopens_with_every_block_and_the_figures_cover_every_key(tmp_path):
    nvme = {}
    for blocks in (500, 2000):
        root = tmp_path / f"nvme-{blocks}"
        scale.build_store(root, blocks)
        got = scale.measure_store(root, blocks, tmp_path / f"empty-{blocks}", lookups=6, compactions=1, reference=500)
        assert got["found"] == got["indexed"] == got["victims"] == blocks  # store, index and victims: all of them
        assert got["removed"] == 0
        assert got["sessions"] == math.ceil(blocks / scale.SESSION_BLOCKS)  # the catalog read back with them
        for key in ("store_s", "catalog_s", "scan_s", "index_s", "startup_s", "server_startup_s", "lookup_s",
                    "lookup_hot_s", "victims_s", "compact_s", "index_bytes_per_block"):
            assert _positive(got[key]), (key, got[key])
        assert math.isfinite(got["ram_bytes_per_block"]) and math.isfinite(got["store_bytes_per_block"])
        assert got["journal_bytes"] == 64 + ENTRY_BYTES * blocks  # compacted: one entry per live block
        if blocks > 500:  # the 500-block reference in the same process, taking turns
            assert got["reference_blocks"] == 500
            assert _positive(got["lookup_vs_reference"]) and _positive(got["victims_per_block_vs_reference"])
        slower = {**got, "lookup_s": 2 * got["lookup_s"], "store_s": 3 * got["store_s"], "found": -1}
        assert scale.combine([slower, got]) == {**slower, "lookup_s": got["lookup_s"], "store_s": got["store_s"],
                                                "processes": 2}  # each timing the lowest, the rest the first's
        nvme[blocks] = got

    catalogs = {}
    for sessions in (300, 1000):
        directory = tmp_path / f"catalog-{sessions}"
        scale.build_catalog(directory, sessions)
        got = scale.measure_catalog(directory)
        assert got["sessions"] == sessions and got["bad_rows"] == 0
        assert _positive(got["open_s"])
        catalogs[sessions] = got

    listed, top = scale.served_figures(20, 0, progress=lambda _msg: None, runs=1)  # top: not here (seconds)
    assert listed["rows"] == 20 and _positive(listed["seconds"]) and top is None

    results = scale.summarize(nvme, catalogs, listed, {"cpu_percent_one_core": 1.5, "server_cpu_percent": 2.0,
                                                       "seconds": 15.0, "exit_code": 0})
    for key in scale.SCALE_KEYS:
        assert _positive(results[key]), (key, results[key])
    assert results["largest_blocks"] == 2000 and results["largest_catalog_sessions"] == 1000
    assert results["startup_s_per_million_blocks"] == pytest.approx(nvme[2000]["startup_s"] * 500)
    assert results["lookup_1m_vs_10k"] == pytest.approx(nvme[2000]["lookup_s"] / nvme[500]["lookup_s"])
    assert results["_lookup_1m_vs_10k_same_process"] == nvme[2000]["lookup_vs_reference"]


def test_a_sessions_page_is_the_full_sort_cut_short(tmp_path):
    """The admin API orders sessions on columns and builds only the rows it answers: for every sort,
    state and limit, the same rows, in the same order, as building every row and sorting them."""
    from benchmarks.top import demo_admin
    from kvtier.control import api
    from kvtier.plan.index import Tier

    admin, engine = demo_admin(tmp_path, 120, churn=False)
    try:
        manager, rng = engine.manager, random.Random(7)
        ids = list(manager.table.sessions)
        for session_id in ids[:12]:
            manager.planner.pin(session_id, Tier.DRAM)
        for session_id in ids[12:30]:
            engine.execute(manager.planner.evict(session_id, Tier.NVME))
        for session in rng.sample(list(manager.table.sessions.values()), 40):
            session.last_use = 5.0  # ties keep the sessions' order
            session.hot = rng.random() < 0.3
        states = {row["state"] for row in manager.views.sessions_overview()}
        assert {"pinned", "hot", "warm", "cold"} <= states

        def full_sort(sort, state, limit):
            rows = [row for row in manager.views.sessions_overview() if not state or row["state"] == state]
            key = {"bytes": lambda r: r["bytes_dram"] + r["bytes_nvme"]}.get(sort, lambda r: r[sort])
            rows.sort(key=key, reverse=sort in ("last_use", "tokens", "bytes"))
            return [r["session_id"] for r in rows[:limit]], len(rows)

        for sort in api.SORT_KEYS:
            for state in (None, *api.STATES):
                for limit in (1, 9, 1000):
                    query = {"sort": sort, "limit": str(limit), **({"state": state} if state else {})}
                    _code, doc = api._sessions(admin.ops, query)
                    assert ([r["session_id"] for r in doc["sessions"]], doc["total"]) == \
                        full_sort(sort, state, limit), (sort, state, limit)
    finally:
        admin.stop()
        engine.close(write_back=False)
