"""vLLM 0.33's sleep mode on a real ``KVTierWorker``: ``unregister_kv_caches`` before vLLM unmaps its
KV memory, ``restore_kv_caches`` after it maps it again. vLLM refuses sleep mode on the CPU platform,
so the hooks are called here as vLLM's GPU worker calls them (sleep: unregister; wake-up: restore),
on CPU KV tensors whose contents are wiped in between as the unmapping wipes them. The jobs come
from a real ``TierManager`` (the scheduler half's), the worker moves real bytes through its DRAM
arena and NVMe store."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from support.realpath import need

from kvtier.connector_config import ConnectorConfig
from kvtier.errors import ConfigError
from kvtier.jobs import BlockMove, Job, JobKind, JobResult
from kvtier.layout import CpuLayout, KVGeometry, ModelFingerprint
from kvtier.plan.index import Tier, chain_block_hashes, namespace_of
from kvtier.plan.manager import TierManager
from kvtier.plugins.vllm.sleep import switch_weights
from kvtier.plugins.vllm.worker import KVTierWorker

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16, dtype="bfloat16")
TOKENS = list(range(500, 564))  # four 16-token blocks
KEYS = chain_block_hashes(TOKENS, 16)
BLOCKS = 16  # vLLM's KV cache: 16 blocks per layer


class Rig:
    """The scheduler half's manager and a real worker half, wired as the connector wires them:
    each ``step`` hands the worker the step's metadata and jobs, then brings the results back."""

    def __init__(self, tmp_path, weights: str = "w1"):
        self.vllm_says = ModelFingerprint("tiny@cpu", GEOMETRY, weights=weights)  # what vLLM's config says now
        self.fingerprint = self.vllm_says  # what the scheduler half plans under
        config = ConnectorConfig(dram_bytes=1 << 20, nvme_dir=str(tmp_path / "nvme"), nvme_bytes=64 << 20,
                                 warm_codec="none", cold_codec="none", write_behind="off", catalog=False,
                                 measure_links=False)
        self.manager = TierManager(self.fingerprint, config.dram_bytes, config.nvme_bytes)
        self.worker = KVTierWorker(self.fingerprint, config, refingerprint=lambda: self.vllm_says)
        torch.manual_seed(0)
        shape = CpuLayout(GEOMETRY).layer_shape(BLOCKS)
        self.layers = [torch.randn(shape).to(torch.bfloat16) for _ in range(GEOMETRY.num_layers)]
        self.worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(self.layers)})

    @property
    def ns(self) -> bytes:
        return namespace_of(self.fingerprint.digest)

    def block(self, i: int) -> torch.Tensor:
        return torch.stack([layer[i].clone() for layer in self.layers])

    def wipe(self) -> None:
        """What the unmapping does to vLLM's KV memory: its contents are gone."""
        for layer in self.layers:
            layer.fill_(float("nan"))

    def step(self, jobs: list[Job]) -> list[JobResult]:
        meta = SimpleNamespace(freed_slots=self.manager.table.slots.drain_freed(), weights=self.fingerprint.weights)
        self.worker.apply(meta)
        self.worker.start_load_kv(jobs, [], [])
        self.worker.wait_for_save(jobs)
        self.worker.mover.jobs.wait_jobs([job.job_id for job in jobs])
        results = [r for r in self.worker.take_results() if r.job_id >= 0]
        for result in results:
            if result.job_id in self.manager.jobbook.jobs:
                self.manager.complete(result)
        return results

    def store(self, session: str, device_blocks: list[int], keys=KEYS) -> None:
        self.manager.planner.record_session(session, self.ns, keys, 16 * len(keys))
        [result] = self.step([self.manager.prepare_store(session, self.ns, keys, device_blocks)])
        assert result.ok, result.error

    def load(self, device_blocks: list[int], keys=KEYS) -> tuple[JobResult, set[int]]:
        job = self.manager.prepare_load(self.manager.table.lookup(self.ns, keys), device_blocks)
        [result] = [r for r in self.step([job]) if r.job_id == job.job_id]
        return result, self.worker.take_load_errors()


def hold_copy_thread(worker: KVTierWorker) -> threading.Event:
    """Occupy the copy thread (a slow copy engine) until the event is set."""
    hold, started = threading.Event(), threading.Event()
    worker.mover.jobs.copy_pool.submit(lambda: (started.set(), hold.wait()))
    assert started.wait(5)
    return hold


def test_a_stored_block_loads_bit_exact_after_a_sleep(tmp_path):
    rig = Rig(tmp_path)
    original = [rig.block(i) for i in range(4)]
    rig.store("s", [0, 1, 2, 3])
    rig.worker.unregister_kv_caches()
    assert rig.worker.mover.copies.kv_layers is None  # the mover holds no view of the unmapped memory
    rig.wipe()
    rig.worker.restore_kv_caches()
    result, errors = rig.load([8, 9, 10, 11])
    assert result.ok and errors == set()
    for i, block in enumerate(original):
        assert torch.equal(rig.block(8 + i), block)
    # and through NVMe: demoted while awake, loaded back after another sleep
    rig.step([rig.manager.planner.evict("s", Tier.NVME)])
    rig.worker.unregister_kv_caches()
    rig.wipe()
    rig.worker.restore_kv_caches()
    result, errors = rig.load([4, 5, 6, 7])
    assert result.ok and errors == set() and rig.manager.telemetry.counters["hit_nvme_blocks"] == 4
    for i, block in enumerate(original):
        assert torch.equal(rig.block(4 + i), block)
    rig.worker.shutdown()


def test_a_store_in_flight_finishes_before_unregister_returns(tmp_path):
    rig = Rig(tmp_path)
    original = rig.block(2)
    rig.manager.planner.record_session("s", rig.ns, KEYS[:1], 16)
    job = rig.manager.prepare_store("s", rig.ns, KEYS[:1], [2])
    hold = hold_copy_thread(rig.worker)
    rig.worker.wait_for_save([job])  # queued behind the held copy thread
    assert rig.worker.mover.jobs.in_flight([job.job_id]) == [job.job_id]
    threading.Timer(0.2, hold.set).start()  # the copy engine frees up while unregister waits
    rig.worker.unregister_kv_caches()
    assert rig.worker.mover.jobs.in_flight([job.job_id]) == []  # it read the KV before the memory went
    [result] = rig.worker.take_results()
    assert result.ok
    rig.manager.complete(result)
    rig.wipe()
    rig.worker.restore_kv_caches()
    loaded, errors = rig.load([5], KEYS[:1])
    assert loaded.ok and errors == set() and torch.equal(rig.block(5), original)
    rig.worker.shutdown()


def test_a_load_in_flight_at_unregister_finishes_first_and_is_reported_as_a_load_error(tmp_path):
    rig = Rig(tmp_path)
    rig.manager.planner.record_session("s", rig.ns, KEYS[:1], 16)
    store = rig.manager.prepare_store("s", rig.ns, KEYS[:1], [0])
    slot = store.moves[0].dram_slot
    hold = hold_copy_thread(rig.worker)
    rig.worker.wait_for_save([store])
    # a load of the same slot: it waits for the store's fence on a mover thread
    load = Job(job_id=10_000, kind=JobKind.LOAD, req_id="r1", moves=[
        BlockMove(row=-1, namespace=rig.ns, key=KEYS[0], dram_slot=slot, nbytes=GEOMETRY.block_bytes, device_block=6)])
    rig.worker.start_load_kv([load], [], [])
    assert rig.worker.mover.jobs.in_flight([load.job_id]) == [load.job_id]
    threading.Timer(0.2, hold.set).start()
    rig.worker.unregister_kv_caches()
    assert rig.worker.mover.jobs.in_flight([store.job_id, load.job_id]) == []
    assert {r.job_id: r.ok for r in rig.worker.take_results()} == {store.job_id: True, load.job_id: True}
    # the bytes landed, but the memory they landed in is unmapped next: vLLM must recompute them
    assert rig.worker.take_load_errors() == {6}
    assert rig.worker.get_finished([])[1] == {"r1"}  # the request is released with its error
    rig.worker.shutdown()


def test_unregister_and_restore_are_idempotent_and_nothing_touches_kv_while_asleep(tmp_path):
    before = KVTierWorker(ModelFingerprint("tiny@cpu", GEOMETRY), ConnectorConfig(dram_bytes=1 << 20))
    before.unregister_kv_caches()  # before register_kv_caches: nothing to drop
    before.restore_kv_caches()
    assert not before.asleep
    rig = Rig(tmp_path)
    original = rig.block(1)
    rig.store("s", [1], KEYS[:1])
    rig.worker.restore_kv_caches()  # awake already: nothing to do
    rig.worker.unregister_kv_caches()
    rig.worker.unregister_kv_caches()
    assert rig.worker.asleep
    rig.wipe()
    # a store or load reaching the worker while it sleeps is refused, never run against the KV memory
    rig.manager.planner.record_session("t", rig.ns, KEYS[1:2], 16)
    [stored] = rig.step([rig.manager.prepare_store("t", rig.ns, KEYS[1:2], [3])])
    assert not stored.ok and "asleep" in stored.error
    loaded, errors = rig.load([7], KEYS[:1])
    assert not loaded.ok and errors == {7} and torch.isnan(rig.block(7)).all()
    rig.worker.restore_kv_caches()
    rig.worker.restore_kv_caches()
    assert not rig.worker.asleep
    loaded, errors = rig.load([7], KEYS[:1])
    assert loaded.ok and errors == set() and torch.equal(rig.block(7), original)
    rig.worker.shutdown()


def test_new_weights_after_a_sleep_load_nothing_stale(tmp_path):
    rig = Rig(tmp_path)
    rig.store("dram", [0, 1], KEYS[:2])
    rig.store("nvme", [2, 3], KEYS[2:])
    rig.step([rig.manager.planner.evict("nvme", Tier.NVME)])
    rig.worker.unregister_kv_caches()
    rig.wipe()
    rig.vllm_says = ModelFingerprint("tiny@cpu", GEOMETRY, weights="w2")  # update_config + reload_weights
    rig.worker.restore_kv_caches()
    assert rig.worker.fingerprint.weights == "w2" and rig.worker.mover.fingerprint.weights == "w2"
    assert rig.worker.take_weights_report() == "w2" and rig.worker.take_weights_report() is None
    assert rig.worker.mover.ledger.due_count(0) == 0  # write-behind never copies an old block under the new weights

    # before the scheduler half has heard of them (or dropped the old blocks): the DRAM ones are
    # refused, the NVMe ones fail their fingerprint check; vLLM recomputes all of them
    for keys, blocks, why in ((KEYS[:2], [8, 9], "weights vLLM ran before it slept"),
                              (KEYS[2:], [10, 11], "written for another model")):
        result, errors = rig.load(blocks, keys)
        assert not result.ok and why in result.error and errors == set(blocks)
        assert all(torch.isnan(rig.block(b)).all() for b in blocks)
    # nor does a demotion carry an old DRAM block to NVMe under the new weights
    [demoted] = rig.step([rig.manager.planner.evict("dram", Tier.NVME)])
    assert not demoted.ok and demoted.error is None  # no disk trouble to report
    assert not any(rig.worker.nvme.has(rig.ns, key) for key in KEYS[:2])
    rig.worker.shutdown()


def test_the_scheduler_half_drops_the_old_sessions_and_plans_under_the_new_weights(tmp_path):
    rig = Rig(tmp_path)
    original = [rig.block(i) for i in range(4)]
    rig.store("dram", [0, 1], KEYS[:2])
    rig.store("nvme", [2, 3], KEYS[2:])
    rig.step([rig.manager.planner.evict("nvme", Tier.NVME)])
    rig.step([job for job in [rig.manager.planner.pin("dram", Tier.DRAM)] if job is not None])  # a pinned one goes too
    rig.worker.unregister_kv_caches()
    rig.vllm_says = ModelFingerprint("tiny@cpu", GEOMETRY, weights="w2")
    rig.worker.restore_kv_caches()
    queued: list[Job] = []
    old_ns = rig.ns
    rig.fingerprint = switch_weights(rig.fingerprint, rig.worker.take_weights_report(), rig.manager,
                                     queued.append)
    assert rig.fingerprint.weights == "w2" and rig.ns != old_ns
    assert rig.manager.table.sessions == {} and "weights_changed" in rig.manager.telemetry.warnings
    assert [job.kind for job in queued] == [JobKind.DROP, JobKind.DROP]  # both have NVMe copies (pin: flushed)
    assert all(rig.worker.nvme.has(old_ns, key) for key in KEYS)
    assert all(r.ok for r in rig.step(queued))
    assert not any(rig.worker.nvme.has(old_ns, key) for key in KEYS)
    assert rig.manager.table.lookup(old_ns, KEYS) == []
    # under the new weights: stored, demoted, loaded back, bit for bit
    rig.store("again", [0, 1, 2, 3])
    rig.step([rig.manager.planner.evict("again", Tier.NVME)])
    result, errors = rig.load([12, 13, 14, 15])
    assert result.ok and errors == set()
    for i, block in enumerate(original):
        assert torch.equal(rig.block(12 + i), block)
    rig.worker.shutdown()


@pytest.mark.parametrize("change, words", [
    (dict(block_tokens=32), "another KV geometry"),
    (dict(dtype="float16"), "another KV geometry"),
    (dict(num_kv_heads=4), "another KV geometry"),
])
def test_waking_up_with_another_geometry_is_refused_in_one_line(tmp_path, change, words):
    rig = Rig(tmp_path)
    rig.store("s", [0], KEYS[:1])
    rig.worker.unregister_kv_caches()
    fields = {**GEOMETRY.to_dict(), **change}
    rig.vllm_says = ModelFingerprint("tiny@cpu", KVGeometry(**fields), weights="w1")
    with pytest.raises(ConfigError) as caught:
        rig.worker.restore_kv_caches()
    assert words in caught.value.message and "\n" not in caught.value.message and caught.value.hint
    assert rig.worker.asleep and rig.worker.mover.copies.kv_layers is None  # still asleep: nothing touches the KV
    rig.worker.shutdown()


def test_kept_tensors_that_changed_shape_are_refused(tmp_path):
    rig = Rig(tmp_path)
    rig.worker.unregister_kv_caches()
    rig.layers[1].resize_(BLOCKS // 2, *rig.layers[1].shape[1:])  # fewer blocks than the tiers were planned on
    with pytest.raises(ConfigError) as caught:
        rig.worker.restore_kv_caches()
    assert "changed shape while it slept (layer 1" in caught.value.message and "\n" not in caught.value.message
    rig.worker.shutdown()


def test_the_connector_says_it_follows_sleep_mode_and_carries_new_weights_to_the_scheduler_half():
    need("vllm")
    from kvtier.plugins.vllm.connector import KVTierConnector, KVTierWorkerMetadata

    assert KVTierConnector.supports_sleep_mode(None) is True
    # vLLM folds every rank's metadata into one: a rank's report of new weights survives the fold
    quiet, woke = KVTierWorkerMetadata([]), KVTierWorkerMetadata([], weights="w2")
    assert quiet.aggregate(woke).weights == "w2" and woke.aggregate(quiet).weights == "w2"
    assert quiet.aggregate(quiet).weights is None
