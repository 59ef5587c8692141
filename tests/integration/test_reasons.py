"""Why did this turn recompute? (issue 18, item 4)

Unit tests of the classifier, the turn log and the drop log (no vLLM), the manager's drop causes
and the admin API / CLI plumbing on a real TierEngine; then one real vLLM engine (the tiny local
model, in-process, with the admin API on a Unix socket) that makes each reason happen through the
connector's real code path: a diverged prefix, blocks dropped by the operator, a hit below the
load break-even, a load that fails its checksum, a prompt below the store threshold, and a session
stored under another weights identity.
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import time

import pytest
from support.engine import make_engine
from support.realpath import need
from typer.testing import CliRunner

from kvtier.plan.index import Tier, chain_block_hashes, namespace_of
from kvtier.plan.reasons import (
    DROP_CAUSES,
    HIT_REASONS,
    REASONS,
    DropLog,
    TurnFacts,
    TurnLog,
    apply_facts,
    classify,
    format_turn,
)

BT = 128  # vLLM's CPU block size (the unit tests use it too)


def facts(**kw) -> TurnFacts:
    prompt = kw.pop("prompt_tokens", 540)
    return TurnFacts(prompt_tokens=prompt, block_tokens=BT, usable_tokens=kw.pop("usable_tokens",
                                                                                 (prompt - 1) // BT * BT),
                     now=1000.0, **kw)


# ---- the classifier (pure) ---------------------------------------------------------------------
@pytest.mark.parametrize("case, expected, words", [
    (dict(found_tokens=512, loaded_tokens=512, load_tier="dram", decision="load"), "full_hit",
     "loaded 512 tokens from dram; 28 new"),
    (dict(vllm_cached_tokens=512, found_tokens=None), "vllm_prefix_cache", "prefix cache held 512"),
    (dict(vllm_cached_tokens=256, found_tokens=256, session_known=True, session_tokens=512, match_tokens=256,
          diverged_at=300), "diverged", "prefix diverged at token 300 from the stored session (512 tokens)"),
    (dict(found_tokens=0, dropped_cause="operator", dropped_at=988.0), "dropped",
     "dropped 12 s before this turn, by the operator (kvtier evict --to drop)"),
    (dict(found_tokens=128, loaded_tokens=128, load_tier="nvme", session_known=True, session_tokens=512,
          match_tokens=512, dropped_cause="nvme_budget", dropped_at=880.0), "dropped",
     "blocks from token 128 were stored once and dropped 2 min before this turn, to stay within the NVMe budget"),
    (dict(found_tokens=512, decision="recompute", load_tier="nvme", restore_s=0.25, recompute_s=0.04),
     "below_break_even", "loading from nvme was predicted at 250 ms, recomputing at 40 ms"),
    (dict(found_tokens=512, loaded_tokens=512, load_tier="nvme", failed_tokens=384,
          load_error="NVMe tier: checksum mismatch in seg-1"), "checksum",
     "failed verification: NVMe tier: checksum mismatch in seg-1; vLLM recomputed 384 tokens from token 128"),
    (dict(found_tokens=0, foreign="its blocks belong to model 'a'"), "fingerprint",
     "another model fingerprint: its blocks belong to model 'a'"),
    (dict(prompt_tokens=100), "below_store_threshold", "not longer than one block (128 tokens)"),
    (dict(found_tokens=0, session_known=True, session_tokens=512, match_tokens=512, stores_skipped=True,
          store_threshold_tokens=2048), "below_store_threshold", "shorter than the DRAM break-even (2048 tokens)"),
    (dict(found_tokens=0), "new_session", "nothing stored for this session yet"),
    (dict(found_tokens=0, session_known=True, session_tokens=512, match_tokens=512), "miss", "are not held"),
    (dict(found_tokens=512, loaded_tokens=512, vanished_tokens=128), "dropped", "between the lookup and the load"),
])
def test_each_reason_is_classified_with_its_detail(case, expected, words):
    reason, detail = classify(facts(**case))
    assert reason == expected and reason in REASONS
    assert words in detail, detail


@pytest.mark.parametrize("row, skipped, dropped, words", [
    (dict(blocks=0, prompt_tokens=24), False, None, "nothing stored: 24 tokens, shorter than one block (128 tokens)"),
    (dict(blocks=3, prompt_tokens=400), True, None, "400 tokens are under the DRAM break-even (2,048 tokens)"),
    (dict(blocks=3, prompt_tokens=400), False, ("operator", 1.0), "dropped by the operator (kvtier evict --to drop)"),
    (dict(blocks=3, prompt_tokens=400, state="hot"), False, None, "its blocks are being stored"),
    (dict(blocks=3, prompt_tokens=400, blocks_dram=1), True, None, None),  # it holds blocks: nothing to explain
])
def test_a_session_row_says_why_it_holds_nothing(row, skipped, dropped, words):
    from kvtier.plan.reasons import stored_note

    info = {"blocks_dram": 0, "blocks_nvme": 0, "state": "gone", **row}
    note = stored_note(info, BT, skipped, 2048, dropped)
    assert note == words if words is None else words in note, note


def test_the_first_cause_wins():
    # a diverged prompt whose matching blocks were also dropped: the drop stopped kvtier first
    dropped = facts(found_tokens=0, session_known=True, session_tokens=512, match_tokens=256, diverged_at=300,
                    dropped_cause="operator", dropped_at=990.0)
    assert classify(dropped)[0] == "dropped"
    # a prompt extending the session, everything the session had loaded: a hit, the rest is new
    extended = facts(found_tokens=384, loaded_tokens=384, load_tier="dram", session_known=True, session_tokens=384,
                     match_tokens=384)
    assert classify(extended)[0] == "full_hit"
    # a checksum failure beats everything: it happened after the decision
    failed = facts(found_tokens=512, loaded_tokens=512, load_tier="nvme", failed_tokens=128, session_known=True,
                   session_tokens=512, match_tokens=512)
    assert classify(failed)[0] == "checksum"


def test_a_record_follows_its_facts_and_formats_as_one_line():
    f = facts(vllm_cached_tokens=128, found_tokens=512, loaded_tokens=384, load_tier="nvme", decision="load")
    record = apply_facts(f, session_id="s", request_id="r1")
    assert (record.reason, record.loaded_tokens, record.recomputed_tokens, record.tier) == ("full_hit", 384, 28, "nvme")
    f.failed_tokens, f.load_error = 256, "checksum mismatch"
    apply_facts(f, record)  # the load failed later: the same record now says so
    assert (record.reason, record.loaded_tokens, record.recomputed_tokens) == ("checksum", 128, 284)
    doc = record.to_dict()
    assert json.loads(json.dumps(doc)) == doc  # what the admin API serves
    line = format_turn({**doc, "turn": 3})
    assert line.startswith("turn 3 · 128 of 540 tokens loaded from nvme · 128 in vLLM's prefix cache · recomputed 284: "
                           "[checksum] a load from nvme failed verification"), line


def test_turn_log_keeps_the_last_turns_of_the_latest_sessions():
    log = TurnLog(per_session=8, max_sessions=3)
    for i in range(20):
        log.add(apply_facts(facts(found_tokens=0), session_id="a", request_id=f"a{i}"))
    assert [t.turn for t in log.of("a")] == list(range(13, 21)) and log.last("a").request_id == "a19"
    for name in "bcd":
        log.add(apply_facts(facts(found_tokens=0), session_id=name, request_id=name))
    assert log.of("a") == [] and len(log) == 3  # the least recently used session went


def test_drop_log_remembers_recent_drops_by_block():
    drops = DropLog(capacity=4)
    ns = namespace_of(b"\x01" * 16)
    keys = chain_block_hashes(list(range(6 * 16)), 16)
    assert drops.find(ns, keys[0]) is None
    drops.note(ns, keys[0], "operator", when=10.0)
    drops.note(ns, keys[0], "nvme_budget", when=20.0)  # dropped again later: the latest counts
    assert drops.find(ns, keys[0]) == ("nvme_budget", 20.0)
    assert drops.find(namespace_of(b"\x02" * 16), keys[0]) is None  # another model or tenant
    for key in keys[1:5]:
        drops.note(ns, key, "dram_full")
    assert drops.find(ns, keys[0]) is None and drops.find(ns, keys[4])[0] == "dram_full"  # bounded
    assert len(drops) == 4 and set(DROP_CAUSES) >= {"operator", "nvme_budget", "dram_full", "not_worth_nvme"}


# ---- the manager remembers why it dropped blocks -----------------------------------------------
def test_manager_remembers_operator_and_pressure_drops(fingerprint, hbm, tmp_path):
    ns = namespace_of(fingerprint.digest)
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=16, nvme_blocks=64)
    keys = chain_block_hashes(list(range(4 * 16)), 16)
    engine.store("agent", ns, keys, [0, 1, 2, 3], num_tokens=64)
    engine.evict("agent", None)
    cause, when = engine.manager.table.drops.find(ns, keys[2])
    assert cause == "operator" and time.time() - when < 60
    engine.close(write_back=False)
    # no NVMe tier: DRAM victims are dropped when new blocks need room
    small = make_engine(fingerprint, hbm, tmp_path / "small", dram_blocks=6, nvme_blocks=0)
    old = chain_block_hashes(list(range(10_000, 10_000 + 4 * 16)), 16)
    small.store("old", ns, old, [0, 1, 2, 3], num_tokens=64)
    small.store("new", ns, chain_block_hashes(list(range(20_000, 20_000 + 4 * 16)), 16), [4, 5, 6, 7], num_tokens=64)
    causes = [small.manager.table.drops.find(ns, k) for k in old]
    assert {c[0] for c in causes if c} == {"dram_full"}, causes
    small.close(write_back=False)


def test_nvme_budget_drops_are_remembered(fingerprint, hbm, tmp_path):
    ns = namespace_of(fingerprint.digest)
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=16, nvme_blocks=4)
    first = chain_block_hashes(list(range(4 * 16)), 16)
    engine.store("first", ns, first, [0, 1, 2, 3], num_tokens=64)
    engine.evict("first", Tier.NVME)
    second = chain_block_hashes(list(range(50_000, 50_000 + 4 * 16)), 16)
    engine.store("second", ns, second, [4, 5, 6, 7], num_tokens=64)
    engine.evict("second", Tier.NVME)  # the NVMe budget holds four blocks: the first session's make room
    found = [engine.manager.table.drops.find(ns, k) for k in first]
    assert any(f is not None and f[0] == "nvme_budget" for f in found), found
    engine.close(write_back=False)


# ---- the admin API and the CLI ------------------------------------------------------------------
def test_inspect_and_metrics_show_turns_by_reason(fingerprint, hbm, tmp_path):
    from kvtier.cli.main import app
    from kvtier.control.client import AdminClient
    from kvtier.control.local import LocalAdmin

    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=16, nvme_blocks=64)
    ns = namespace_of(fingerprint.digest)
    engine.store("agent", ns, chain_block_hashes(list(range(4 * 16)), 16), [0, 1, 2, 3], num_tokens=64)
    record = apply_facts(facts(vllm_cached_tokens=256, found_tokens=256, session_known=True, session_tokens=512,
                               match_tokens=256, diverged_at=300), session_id="agent", request_id="req-1")
    engine.manager.turns.add(record)
    engine.manager.telemetry.counters["turns_diverged"] += 1
    engine.manager.telemetry.counters["recomputed_tokens_diverged"] += record.recomputed_tokens
    sock = tmp_path / "run" / "kvtier.sock"
    admin = LocalAdmin(engine, sock).start()
    try:
        doc = AdminClient(str(sock)).get("/v1/sessions/agent")
        assert [t["reason"] for t in doc["turns"]] == ["diverged"] and doc["turns"][0]["diverged_at"] == 300
        out = CliRunner().invoke(app, ["inspect", "agent", "--socket", str(sock)])
        assert out.exit_code == 0, out.output
        assert "turn 1 · 540 tokens, none loaded · 256 in vLLM's prefix cache · recomputed 284: [diverged] prefix " \
               "diverged at token 300 from the stored session" in out.output.replace("\n  ", " "), out.output
        text = AdminClient(str(sock)).request("GET", "/metrics", raw=True)
        assert 'kvtier_turns_total{reason="diverged"} 1.0' in text
        assert 'kvtier_misses_total{reason="diverged"} 1.0' in text
        assert f'kvtier_recompute_tokens_total{{reason="diverged"}} {float(record.recomputed_tokens)}' in text
        assert 'kvtier_misses_total{reason="full_hit"}' not in text and all(
            f'kvtier_turns_total{{reason="{r}"}}' in text for r in REASONS)
        assert set(HIT_REASONS) < set(REASONS)
    finally:
        admin.stop()
        engine.close(write_back=False)


# ---- on real vLLM (the tiny local model, in-process) --------------------------------------------
_VLLM_TMP = tempfile.mkdtemp(prefix="kvtier-vllm-")
for _key, _value in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                     "VLLM_CACHE_ROOT": os.path.join(_VLLM_TMP, "cache")}.items():
    os.environ.setdefault(_key, _value)


def prompt_of(seed: int, tokens: int) -> list[int]:
    return [3 + (seed * 7919 + i * 31) % 1900 for i in range(tokens)]


class Served:
    """One in-process vLLM engine with kvtier (DRAM, NVMe, session catalog, admin API on a socket),
    its cost model pinned (a fixed prefill fit, the default link rates) so that the decisions the
    tests rely on do not depend on this box's speed."""

    def __init__(self, model: str, root, socket_name: str = "admin.sock"):
        from vllm import LLM
        from vllm.config import KVEventsConfig, KVTransferConfig

        from kvtier.plan.costmodel import PrefillModel

        self.nvme = root / "nvme"
        self.sock = str(root / "run" / socket_name)
        extra = {"dram_bytes": 256 << 20, "model_id": "kvtier-demo-tiny", "nvme_dir": str(self.nvme),
                 "nvme_bytes": 1 << 30, "admin_socket": self.sock, "measure_links": "false", "write_behind": "off"}
        self.llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=2048,
                       enforce_eager=True, enable_prefix_caching=True, seed=0,
                       kv_transfer_config=KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both",
                                                           kv_load_failure_policy="recompute",
                                                           kv_connector_extra_config=extra),
                       # what kvtier serve passes: vLLM's KV cache events, for HBM as vLLM holds it
                       kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                       endpoint=f"inproc://kvtier-{socket_name}", topic="kvtier"))
        self.scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
        cost = self.scheduler.cost
        cost.prefill = PrefillModel(overhead_s=0.002, per_token_s=50e-6, attention_s=0.0, points=99)
        cost.observe_prefill = lambda *a, **k: None  # keep the fit above (this box's timings vary)
        cost.observe_load = lambda *a, **k: None
        self.rates = cost.rates
        self._ids = 0

    @property
    def manager(self):
        return self.scheduler.manager

    def turn(self, session: str, prompt: list[int], max_tokens: int = 4):
        """One request of ``session``, run to its end; its turn as the admin API serves it."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        self._ids += 1
        engine.add_request(f"{session}-{self._ids}", TokensPrompt(prompt_token_ids=list(prompt)),
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), session_id=session)
        while engine.has_unfinished_requests():
            engine.step()
        with self.scheduler.lock:
            record = self.manager.turns.last(session)
        assert record is not None and record.finished and record.prompt_tokens == len(prompt), record
        return record

    def reset(self, timeout_s: float = 60.0) -> None:
        """Empty vLLM's prefix cache for real: vLLM refuses while a request's blocks are still held
        for kvtier's stores in flight (reported in a later step), and says so only by returning False."""
        import time

        deadline = time.monotonic() + timeout_s
        while not self.llm.reset_prefix_cache():
            assert time.monotonic() < deadline, "vLLM's prefix cache still in use"
            self.llm.llm_engine.step()  # an empty step: the worker reports its finished stores

    def crawl(self) -> None:
        """A host link at 1 KB/s: no load can beat recomputing (and nothing is worth storing)."""
        self.scheduler.cost.refresh_rates(self.rates.capped({"pcie": 1e-6}))

    def normal(self) -> None:
        self.scheduler.cost.refresh_rates(self.rates)

    def admin(self):
        from kvtier.control.client import AdminClient

        return AdminClient(self.sock)

    def wait_job(self, job: dict, timeout_s: float = 120.0) -> dict:
        """Step the engine (short requests) until an admin job is done: jobs travel with steps."""
        client = self.admin()
        deadline = time.monotonic() + timeout_s
        while job["state"] not in ("done", "failed"):
            assert time.monotonic() < deadline, job
            self.turn("poke", prompt_of(99, 40), max_tokens=1)
            job = client.get(f"/v1/jobs/{job['id']}")
        return job

    def close(self) -> None:
        if self.llm is None:
            return
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        self.llm.llm_engine.engine_core.shutdown()
        ensure_kv_transfer_shutdown()
        self.llm = None
        gc.collect()


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    need("vllm")
    engine = Served(str(tiny_model), tmp_path_factory.mktemp("reasons"))
    yield engine
    engine.close()


def inspect_output(served, session: str) -> str:
    from kvtier.cli.main import app

    out = CliRunner().invoke(app, ["inspect", session, "--socket", served.sock])
    assert out.exit_code == 0, out.output
    return out.output


@pytest.mark.slow
def test_vllm_hits_name_where_the_tokens_came_from(served):
    prompt = prompt_of(9, 300)
    first = served.turn("hit", prompt)
    assert first.reason == "new_session" and first.loaded_tokens == 0 and first.recomputed_tokens == 300
    again = served.turn("hit", prompt)  # vLLM's own prefix cache still holds it
    assert again.reason == "vllm_prefix_cache" and again.vllm_cached_tokens == 256 and again.loaded_tokens == 0
    served.reset()  # vLLM forgets: kvtier loads it from DRAM
    longer = served.turn("hit", prompt + prompt_of(10, 100))
    assert (longer.reason, longer.tier, longer.loaded_tokens, longer.vllm_cached_tokens) == ("full_hit", "dram", 256, 0)
    assert longer.recomputed_tokens == 144 and [t["turn"] for t in served.admin().get("/v1/sessions/hit")["turns"]] \
        == [1, 2, 3]


@pytest.mark.slow
def test_vllm_diverged_prefix_names_the_token(served):
    prompt = prompt_of(1, 400)
    assert served.turn("div", prompt).reason == "new_session"
    edited = list(prompt)
    edited[300] += 1  # the user edited an earlier message: same first 300 tokens, then different
    record = served.turn("div", edited)
    assert record.reason == "diverged" and record.diverged_at == 300, record
    assert record.vllm_cached_tokens == 256 and record.recomputed_tokens == 144
    doc = served.admin().get("/v1/sessions/div")
    assert doc["turns"][-1]["reason"] == "diverged" and doc["turns"][-1]["diverged_at"] == 300
    text = " ".join(inspect_output(served, "div").split())
    assert "turn 2 · 400 tokens, none loaded · 256 in vLLM's prefix cache · recomputed 144: [diverged] prefix " \
           "diverged at token 300 from the stored session (384 tokens)" in text, text


def metric(served, name: str, reason: str) -> float:
    text = served.admin().request("GET", "/metrics", raw=True)
    return float(text.split(f'{name}{{reason="{reason}"}} ')[1].split()[0])


@pytest.mark.slow
def test_vllm_dropped_blocks_name_the_operator(served):
    prompt = prompt_of(2, 400)
    served.turn("drop", prompt)
    job = served.admin().post("/v1/sessions/drop/evict", {"to": "drop"})  # kvtier evict drop --to drop
    assert job["state"] in ("queued", "running", "done"), job
    served.reset()
    misses, tokens = metric(served, "kvtier_misses_total", "dropped"), metric(served, "kvtier_recompute_tokens_total",
                                                                               "dropped")
    record = served.turn("drop", prompt + prompt_of(3, 100))
    assert record.reason == "dropped" and record.dropped_cause == "operator", record
    assert "by the operator" in record.detail and record.loaded_tokens == 0 and record.recomputed_tokens == 500
    assert "[dropped] blocks from token 0 were stored once and dropped" in " ".join(
        inspect_output(served, "drop").split())
    # /metrics counts the turn by its reason, and the tokens it recomputed
    assert metric(served, "kvtier_misses_total", "dropped") == misses + 1
    assert metric(served, "kvtier_recompute_tokens_total", "dropped") == tokens + 500


@pytest.mark.slow
def test_vllm_below_break_even_gives_both_predicted_times(served):
    prompt = prompt_of(4, 400)
    served.turn("bbe", prompt)
    served.crawl()
    try:
        served.reset()
        record = served.turn("bbe", prompt + prompt_of(5, 100))
    finally:
        served.normal()
    assert record.reason == "below_break_even" and record.stored_tokens_found == 384, record
    assert record.loaded_tokens == 0 and record.restore_s > record.recompute_s > 0
    turn = served.admin().get("/v1/sessions/bbe")["turns"][-1]
    assert turn["restore_s"] == record.restore_s and turn["recompute_s"] == record.recompute_s
    assert "recomputing at" in " ".join(inspect_output(served, "bbe").split())


@pytest.mark.slow
def test_vllm_checksum_failure_is_named(served):
    from kvtier.tiers.nvme.store import NvmeStore

    prompt = prompt_of(6, 600)
    served.turn("sum", prompt)
    job = served.wait_job(served.admin().post("/v1/sessions/sum/evict", {"to": "nvme"}))
    assert job["state"] == "done", job
    with served.scheduler.lock:
        session = served.manager.table.sessions["sum"]
        namespace, keys = session.namespace, list(session.keys)
    store = NvmeStore(served.nvme, 1 << 40, io_threads=1, readonly=True)
    try:
        path, offset, size = store.locate(namespace, keys[1])  # the session's second block
    finally:
        store.close()
    with open(path, "r+b") as f:  # one flipped byte in its payload, under the running server
        byte = os.pread(f.fileno(), 1, offset + size // 2)
        os.pwrite(f.fileno(), bytes([byte[0] ^ 0x5A]), offset + size // 2)
    served.reset()
    record = served.turn("sum", prompt + prompt_of(7, 60))
    assert record.reason == "checksum" and record.tier == "nvme", record
    assert record.loaded_tokens == 128 and record.recomputed_tokens == 660 - 128  # block 0 loaded, the rest recomputed
    assert "failed verification" in record.detail and "checksum" in record.detail
    assert "[checksum]" in inspect_output(served, "sum")


@pytest.mark.slow
def test_vllm_prompts_below_the_store_threshold(served):
    record = served.turn("tiny", prompt_of(8, 100))  # under one block
    assert record.reason == "below_store_threshold" and "not longer than one block (128 tokens)" in record.detail
    prompt = prompt_of(11, 300)
    served.crawl()  # nothing loads faster than it recomputes: nothing is stored
    try:
        first = served.turn("short", prompt)
        assert first.reason == "new_session" and first.store_skipped
        served.reset()
        again = served.turn("short", prompt)
    finally:
        served.normal()
    assert again.reason == "below_store_threshold" and "DRAM break-even" in again.detail, again


@pytest.mark.slow
def test_vllm_a_session_is_listed_from_its_first_request_and_says_why_nothing_is_stored(served):
    """Issue 32: the README's first request (shorter than one block) made a session that `kvtier
    sessions` did not list and `kvtier inspect` did not know."""
    from kvtier.cli.main import app

    served.turn("agent-42", prompt_of(21, 20))
    rows = {s["session_id"]: s for s in served.admin().get("/v1/sessions")["sessions"]}
    assert rows["agent-42"]["blocks"] == 0 and rows["agent-42"]["prompt_tokens"] == 24, rows["agent-42"]
    out = CliRunner().invoke(app, ["sessions", "--socket", served.sock], terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "agent-42: nothing stored: 24 tokens, shorter than one block (128 tokens)" in out.output, out.output
    text = " ".join(inspect_output(served, "agent-42").split())
    assert "│ stored │ nothing stored: 24 tokens" in text and "not longer than one block" in text, text


@pytest.mark.slow
def test_vllm_prefix_cache_blocks_show_in_hbm_and_their_session_hot(served):
    """Issue 32: after a turn, vLLM keeps its blocks as prefix cache: HBM shows them, and the session
    whose next turn would hit them is hot."""
    served.turn("cached-a", prompt_of(31, 700))  # 5 full blocks (of 128 tokens) with the reply
    cache = served.scheduler.hbm_cache
    assert cache is not None and cache.listening
    assert cache.wait_for(lambda: cache.session_blocks("cached-a") >= 5, 30.0), cache.sessions()
    client = served.admin()
    vllm = client.get("/v1/status")["vllm"]  # the vLLM the server runs, and whether kvtier was tested on it
    assert vllm["version"].startswith("0.32.") and vllm["tested"] is True, vllm
    status = client.get("/v1/status")["tiers"]["hbm"]
    assert status["source"] == "kv_events" and status["running_blocks"] == 0, status
    assert status["cached_blocks"] >= 5 and status["used_bytes"] == status["reclaimable_bytes"] > 0, status
    row = client.get("/v1/sessions/cached-a")
    assert row["state"] == "hot" and row["blocks_hbm"] >= 5, row
    assert row["bytes_hbm"] == row["blocks_hbm"] * served.scheduler.fingerprint.geometry.block_bytes
    assert "cached-a" in [s["session_id"] for s in client.get("/v1/sessions", state="hot")["sessions"]]
    served.reset()  # vLLM drops its prefix cache: the session is no longer hot
    served.turn("poke", prompt_of(99, 40), max_tokens=1)  # vLLM publishes a step's events after the step
    assert cache.wait_for(lambda: not cache.session_blocks("cached-a"), 30.0), cache.sessions()
    row = client.get("/v1/sessions/cached-a")
    assert row["state"] != "hot" and row["blocks_hbm"] == 0, row


@pytest.mark.slow
def test_vllm_fingerprint_mismatch_names_both_weights(served, tiny_model, tmp_path):
    """Runs last in this module: it stops the shared engine and serves other weights (the same model
    with its config changed, as when a fine-tune replaces a model in place) on the same NVMe dir."""
    prompt = prompt_of(12, 400)
    served.turn("fp", prompt)
    old_weights = served.scheduler.fingerprint.weights
    served.close()  # its session catalog is written at shutdown
    other = tmp_path / "model-v2"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    config["kvtier_test_revision"] = 2
    (other / "config.json").write_text(json.dumps(config))
    again = Served(str(other), served.nvme.parent, socket_name="admin-v2.sock")
    try:
        assert again.scheduler.fingerprint.weights != old_weights
        record = again.turn("fp", prompt)
        assert record.reason == "fingerprint", record
        assert f"weights {old_weights}" in record.detail and again.scheduler.fingerprint.weights in record.detail
        assert "[fingerprint] the session is stored under another model fingerprint" in " ".join(
            inspect_output(again, "fp").split())
    finally:
        again.close()
