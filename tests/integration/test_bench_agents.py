"""`kvtier bench agents` end to end on real servers (plain vLLM and kvtier serve on the tiny demo
model), small: one regime, a few sessions. The figures are not judged here (benchmarks are for
that); what is checked is that every arm saw every turn, kvtier loaded what plain vLLM had to
recompute, outputs match in the determinism pass, an arm that cannot start is skipped with its
reason while the others run, and the records and results are written whole."""
from __future__ import annotations

import json

import pytest

from kvtier.bench.agents.run import AgentRun, finish_agents_bench
from kvtier.bench.agents.trace import AgentMix

pytestmark = pytest.mark.slow

MiB = 1 << 20


@pytest.mark.parametrize("together", [True, False], ids=["servers-together", "one-at-a-time"])
def test_agents_bench_small_run(tiny_model, tmp_path, together):
    native_skips = __import__("kvtier.launch.serve", fromlist=["is_cpu_only"]).is_cpu_only()
    arms = ["vllm", "kvtier", "native"] if together else ["vllm", "kvtier"]  # one skip is enough
    run = AgentRun(model=str(tiny_model), regimes=[2], arms=arms, seeds=[0],
                   engine_kv=8 * MiB, dram=32 * MiB, concurrency=2, sessions=6, workdir=tmp_path / "out",
                   mix=AgentMix(shared_tokens=256, prefix_median=512, tool_median=96, max_context=2048,
                                long_pause_s=2.0, think_median_s=0.2),
                   hints=False, together=together)
    said: list[str] = []
    results = finish_agents_bench(run, tmp_path / "cdf.png", said.append)

    records = [json.loads(line) for line in open(results["records"])]
    turns = {(r["session"], r["turn"]) for r in records if r["server"] == "kvtier"}
    assert turns == {(r["session"], r["turn"]) for r in records if r["server"] == "vllm"}
    assert {r["server"] for r in records} == {"vllm", "kvtier", "vllm-again"}
    assert results["errors"] == 0 and not any(r["error"] for r in records)

    kv, plain = results["arms"]["kvtier"]["regimes"]["2"], results["arms"]["vllm"]["regimes"]["2"]
    assert kv["loaded_tokens"] > 0 and plain["loaded_tokens"] == 0
    assert kv["recomputed_tokens"] < plain["recomputed_tokens"]  # what plain vLLM forgot, kvtier loaded
    assert "degraded" not in results["arms"]["kvtier"]
    assert results["determinism"]["outputs_equal"] == 1.0
    assert results["r2_ttft_p50_vs_vllm"] is not None and results["r2_recomputed_vs_vllm"] < 1.0
    if native_skips and together:  # vLLM's own offloading refuses the CPU platform: skipped, with its words
        assert "only supported on CUDA" in results["skipped"]["native"]
        assert any("native: skipped" in line for line in said)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["r2_ttft_p50_vs_vllm"] == pytest.approx(results["r2_ttft_p50_vs_vllm"])
    assert (tmp_path / "cdf.png").stat().st_size > 1000
