"""The cost model and the one load decision: fits, splits, caps, measurements, and what the admin API
reports. Oracles here are written out scalar by scalar, not with the model's vectorised code."""
from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import UsageError
from kvtier.plan.costmodel import GB, CostModel, LinkRates, PrefillModel, measure_rates, parse_link_caps
from kvtier.plan.decide import LoadCandidate, blocks_to_load

BT = 16
TRUE = PrefillModel(overhead_s=0.002, per_token_s=50e-6, attention_s=2e-9)


def truth(start: int, tokens: int) -> float:
    return 0.002 + 50e-6 * tokens + 2e-9 * (tokens * start + tokens * tokens / 2) if tokens else 0.0


def model(h2d_gbps: float, nvme_gbps: float, prefill=TRUE, block_bytes: int = 64 << 10) -> CostModel:
    rates = LinkRates(h2d_gbps * GB, nvme_gbps * GB, nvme_latency_s=1e-4, job_latency_s=3e-4)
    return CostModel(rates, BT, block_bytes, block_bytes, prefill=prefill)


def scalar_load(m: CostModel, dram: int, nvme: int) -> float:
    if dram + nvme == 0:
        return 0.0
    r = m.rates
    t = r.round_trip_s + r.job_latency_s + (dram + nvme) * m.dram_block_bytes / r.host_to_device_bps
    if nvme:
        t += r.nvme_latency_s + nvme * m.nvme_block_bytes / r.nvme_read_bps
    return t


def brute_force_split(m: CostModel, computed: int, flags: list[bool], prompt: int) -> int:
    best_k, best_t = 0, float("inf")
    for k in range(len(flags) + 1):
        dram = sum(flags[:k])
        start = (computed + k) * BT
        t = scalar_load(m, dram, k - dram) + truth(start, max(prompt - start, 0))
        if t < best_t - 1e-12:
            best_k, best_t = k, t
    full = scalar_load(m, sum(flags), len(flags) - sum(flags)) + truth((computed + len(flags)) * BT,
                                                                       max(prompt - (computed + len(flags)) * BT, 0))
    return len(flags) if full <= best_t * (1 + m.margin) else best_k


def test_prefill_fit_recovers_the_terms():
    points = [(s, n, truth(s, n)) for s in (0, 512, 4096, 12288) for n in (256, 512, 2048)]
    fitted = PrefillModel.fit(points)
    assert fitted.per_token_s == pytest.approx(50e-6, rel=1e-3)
    assert fitted.attention_s == pytest.approx(2e-9, rel=1e-3)
    assert fitted.seconds(16384, 2048) == pytest.approx(truth(16384, 2048), rel=1e-3)


def test_prefill_fit_needs_distinct_shapes_and_clamps_a_negative_term():
    assert PrefillModel.fit([(0, 512, 0.1)] * 10) is None

    def no_overhead(s: int, n: int) -> float:
        return 50e-6 * n + 2e-9 * (n * s + n * n / 2)

    # short steps measured fast, long ones slow: plain least squares answers a negative fixed cost
    points = [(s, n, no_overhead(s, n) * (0.9 if n == 128 else 1.1)) for s in (0, 1024, 8192) for n in (128, 1024)]
    start, tokens, seconds = np.asarray(points, dtype=np.float64).T
    design = np.stack([np.ones_like(tokens), tokens, tokens * start + tokens * tokens / 2], axis=1)
    plain = np.linalg.lstsq(design / seconds[:, None], np.ones_like(seconds), rcond=None)[0]
    assert plain[0] < 0  # the case under test
    fitted = PrefillModel.fit(points)
    assert fitted.overhead_s == 0.0  # clamped, and the other terms refitted without it
    assert fitted.per_token_s == pytest.approx(50e-6, rel=0.1)
    assert fitted.attention_s == pytest.approx(2e-9, rel=0.1)
    assert fitted.seconds(8192, 1024) == pytest.approx(no_overhead(8192, 1024), rel=0.15)


def test_the_model_learns_from_observed_steps():
    m = model(20, 3, prefill=None)
    assert m.recompute_seconds(0, 4096) is None
    m.observe_prefill(0, 512, 5.0)  # warm-up steps (allocation, compilation) are not samples
    m.observe_prefill(0, 512, 5.0)
    shapes = [(0, 512), (512, 512), (1024, 512), (0, 2048), (2048, 2048), (4096, 2048), (0, 128), (8192, 256)]
    for s, n in shapes[:5]:
        m.observe_prefill(s, n, truth(s, n))
    assert m.prefill is None  # too few samples to trust a fit
    for s, n in shapes[5:]:
        m.observe_prefill(s, n, truth(s, n))
    assert m.recompute_seconds(0, 8192) == pytest.approx(truth(0, 8192), rel=0.01)


@pytest.mark.parametrize("h2d, nvme, flags, expect", [
    (20, 3, [True] * 64, "load"),  # fast links: everything loads
    (0.001, 0.001, [True] * 64, "recompute"),  # a link so slow that loading never pays
    (20, 0.002, [True] * 32 + [False] * 32, "split"),  # DRAM front loads, the slow NVMe tail recomputes
])
def test_best_split_matches_a_brute_force_oracle(h2d, nvme, flags, expect):
    m = model(h2d, nvme)
    prompt = (2 + len(flags)) * BT + 40
    split = m.best_split(2, flags, prompt)
    assert split.blocks == brute_force_split(m, 2, flags, prompt)
    assert split.decision == expect
    if expect == "split":
        assert split.blocks == 32
        assert split.total_s < split.all_load_s and split.total_s < split.none_load_s


def test_blocks_to_load_without_a_model_loads_every_hit():
    candidate = LoadCandidate(0, 10, 10, BT)
    assert blocks_to_load(candidate) == 10
    assert blocks_to_load(candidate, model(20, 3, prefill=None)) == 10
    assert blocks_to_load(LoadCandidate(0, 0, 0, BT)) == 0
    slow = model(0.001, 0.001)
    assert blocks_to_load(LoadCandidate(0, 10, 10, BT, prompt_tokens=200), slow) == 0


def test_break_even_is_later_from_nvme_and_absent_on_a_crawling_link():
    m = model(12, 1.5, block_bytes=512 << 10)
    dram, nvme = m.break_even_tokens(False), m.break_even_tokens(True)
    assert dram is not None and nvme is not None and dram <= nvme
    assert model(0.0005, 0.0005, block_bytes=512 << 10).break_even_tokens(True, limit=1 << 16) is None
    assert m.restore_beats_recompute(200_000) is True


@pytest.mark.parametrize("spec, caps", [("pcie=3.9", {"pcie": 3.9}), ("pcie=3.9, nvme=1.5", {"pcie": 3.9, "nvme": 1.5}),
                                        ("", {}), ({"nvme": 2}, {"nvme": 2.0})])
def test_link_caps_parse(spec, caps):
    assert parse_link_caps(spec) == caps


@pytest.mark.parametrize("spec", ["pcie", "gpu=3", "pcie=fast", "pcie=-1", "nvme=1e9"])
def test_bad_link_caps_are_usage_errors(spec):
    with pytest.raises(UsageError) as err:
        parse_link_caps(spec)
    assert err.value.hint


def test_caps_lower_measured_rates_and_say_so(tmp_path):
    rates = measure_rates(tmp_path, {"pcie": 0.5, "nvme": 0.25}, quick=True)
    assert rates.host_to_device_bps == pytest.approx(0.5 * GB) and rates.nvme_read_bps <= 0.25 * GB
    assert "capped" in rates.source["host_to_device_bps"]
    measured = measure_rates(tmp_path, quick=True)
    assert measured.host_to_device_bps > 0.05 * GB and measured.nvme_read_bps > 0
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone


def test_admin_session_view_reports_the_prediction(fingerprint, hbm, tmp_path):
    from support.engine import make_engine

    from kvtier.control.client import AdminClient
    from kvtier.control.local import LocalAdmin
    from kvtier.plan.index import chain_block_hashes, namespace_of

    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=16, nvme_blocks=16)
    ns = namespace_of(fingerprint.digest)
    engine.store("agent", ns, chain_block_hashes(list(range(64)), 16), [0, 1, 2, 3], num_tokens=64)
    admin = LocalAdmin(engine, tmp_path / "a.sock").start()
    try:
        client = AdminClient(str(tmp_path / "a.sock"))
        assert client.get("/v1/sessions/agent")["decision"] is None  # no model: nothing claimed
        geometry = fingerprint.geometry
        admin.ops.cost = model(20, 3, block_bytes=geometry.block_bytes)
        doc = client.get("/v1/sessions/agent")
        assert doc["restore_s"] == pytest.approx(scalar_load(admin.ops.cost, 4, 0))
        assert doc["recompute_s"] == pytest.approx(truth(0, 64))
        assert doc["decision"] == ("load" if doc["restore_s"] < doc["recompute_s"] else "recompute")
        admin.ops.cost = model(0.00001, 0.00001, block_bytes=geometry.block_bytes)
        assert client.get("/v1/sessions/agent")["decision"] == "recompute"
        assert 'kvtier_load_decisions_total{decision="load"}' in client.request("GET", "/metrics", raw=True)
    finally:
        admin.stop()
        engine.close(write_back=False)


def test_doctor_without_a_server(tmp_path):
    import json

    from typer.testing import CliRunner

    from kvtier.cli.main import app

    runner = CliRunner()
    out = runner.invoke(app, ["doctor", "--json", "--quick", "--nvme-dir", str(tmp_path / "nvme"), "--socket",
                              str(tmp_path / "none.sock"), "--link-gbps", "pcie=0.1"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output[out.output.index("{"):])
    # a cap far below any memcpy (2 GB/s was not, on a loaded 2-core machine): the cap is what counts
    assert report["rates"]["host_to_device_gbps"] == pytest.approx(0.1)
    assert report["nvme"]["o_direct"] in (True, False) and report["nvme"]["free_bytes"] > 0
    assert report["kv"]["bytes_per_token"] == 2 * report["kv"]["layers"] * report["kv"]["kv_heads"] * \
        report["kv"]["head_dim"] * 2
    assert any("no server" in w for w in report["warnings"])
    assert report["gpu"]["present"] or report["gpu"]["why"]  # no GPU: it says why (kvtier.control.gpu)
    bad = runner.invoke(app, ["doctor", "--model", str(tmp_path), "--socket", str(tmp_path / "none.sock")])
    assert bad.exit_code == 2 and "config.json" in bad.output and "hint:" in bad.output


def test_doctor_measures_each_drive_and_all_of_them(tmp_path):
    import json

    from typer.testing import CliRunner

    from kvtier.cli.main import app

    a, b = tmp_path / "d0", tmp_path / "d1"
    out = CliRunner().invoke(app, ["doctor", "--json", "--quick", "--nvme-dir", str(a), "--nvme-dir", str(b),
                                   "--socket", str(tmp_path / "none.sock")])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output[out.output.index("{"):])
    assert [d["dir"] for d in report["drives"]] == [str(a), str(b)]
    assert all(d["read_gbps"] > 0 for d in report["drives"]) and report["rates"]["nvme_read_gbps"] > 0
    assert any("one filesystem" in w for w in report["warnings"])  # two directories, one disk
    human = CliRunner().invoke(app, ["doctor", "--quick", "--nvme-dir", str(a), "--nvme-dir", str(b),
                                     "--socket", str(tmp_path / "none.sock")])
    assert "NVMe drive 0" in human.output and "NVMe drive 1" in human.output


def test_doctor_reads_break_even_from_a_server(fingerprint, hbm, tmp_path):
    import json

    from support.engine import make_engine
    from typer.testing import CliRunner

    from kvtier.cli.main import app
    from kvtier.control.local import LocalAdmin

    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=8, nvme_blocks=8)
    admin = LocalAdmin(engine, tmp_path / "a.sock").start()
    admin.ops.cost = model(0.0001, 0.0001, block_bytes=fingerprint.geometry.block_bytes)  # a crawling link
    try:
        out = CliRunner().invoke(app, ["doctor", "--json", "--quick", "--socket", str(tmp_path / "a.sock"),
                                       "--nvme-dir", str(tmp_path / "n")])
        report = json.loads(out.output[out.output.index("{"):])
        assert report["server"]["costmodel"]["available"]
        assert any("never beats recomputing" in w for w in report["warnings"])
    finally:
        admin.stop()
        engine.close(write_back=False)


def test_observed_dram_loads_refit_latency_and_rate():
    m = model(20, 3)  # the start-up measurement says 20 GB/s and 0.3 ms a job
    latency, per_byte = 0.002, 1 / (2 * GB)  # what the mover really does: 2 GB/s, 2 ms a job
    m.observe_load(1 << 20, latency + (1 << 20) * per_byte)
    # one job can't tell latency from rate: the rate is what it measured, the latency the rates' own
    assert m.load_fit == pytest.approx((3e-4, (latency - 3e-4 + (1 << 20) * per_byte) / (1 << 20)), rel=1e-6)
    for blocks in (1, 4, 16, 64, 2, 32):
        nbytes = blocks * m.dram_block_bytes
        m.observe_load(nbytes, latency + nbytes * per_byte)
    assert m.load_fit == pytest.approx((latency, per_byte), rel=1e-3)
    round_trip = m.rates.round_trip_s  # not the mover's: the engine step the load adds (not in the jobs)
    assert m.load_seconds(100, 0) == pytest.approx(round_trip + latency + 100 * m.dram_block_bytes * per_byte,
                                                   rel=1e-3)
    assert m.report()["dram_load"]["gbps"] == pytest.approx(2.0, rel=1e-3)
    same_size = model(20, 3)
    for _ in range(10):  # a single job size: the rate from the jobs, the latency still the rates'
        same_size.observe_load(1 << 20, 0.01)
    assert same_size.load_fit == pytest.approx((3e-4, (0.01 - 3e-4) / (1 << 20)), rel=1e-6)


def test_a_short_restore_is_predicted_with_what_it_really_costs():
    """A restore of 15 blocks on the CPU dev box: the mover's job took 2 ms (the start-up memcpy said
    0.5 ms) and the request paid one more engine step than a recompute, ~1.5 ms, for the load's
    round trip. Both are in the prediction after the first load; the tail recompute is unchanged."""
    block = 256 << 10
    m = model(13.6, 1.5, block_bytes=block)  # the start-up measurement: one large memcpy
    naive = 3e-4 + 15 * block / (13.6 * GB)  # job latency + bytes / measured rate: what it used to say
    assert m.load_seconds(15, 0) == pytest.approx(naive + m.rates.round_trip_s)
    assert m.rates.round_trip_s >= 1e-3  # the extra engine step: a millisecond or more, not a job's 0.3 ms
    assert m.load_seconds(0, 0) == 0.0  # recomputing everything pays no round trip
    m.observe_load(15 * block, 2e-3)  # the first load, as the mover timed it
    assert m.load_seconds(15, 0) == pytest.approx(2e-3 + m.rates.round_trip_s, rel=1e-6)
    m.observe_load(63 * block, 5.6e-3)  # the next one, 4x larger: still the rate only (too few to fit)
    per_byte = np.median([(2e-3 - 3e-4) / (15 * block), (5.6e-3 - 3e-4) / (63 * block)])
    assert m.load_seconds(127, 0) == pytest.approx(m.rates.round_trip_s + 3e-4 + 127 * block * per_byte, rel=1e-6)


def test_the_step_after_a_load_is_measured_and_one_slow_step_does_not_make_every_load_slow():
    """The restore's tail step runs longer than plain prefill of the same shape: the model measures
    by how much (a ratio: the tail of a long prompt loses more) and keeps those steps out of the
    prefill fit. With few samples the smallest counts: one step slowed by something else must not
    inflate every later prediction."""
    m = model(20, 3)
    m._seen = m.WARMUP_STEPS + 1  # past the warm-up: steps count
    tail = TRUE.seconds(1920, 128)
    assert m.after_load_factor() == 1.0
    for ratio in (1.25, 9.0, 1.3):  # the middle one: a step that something else slowed down
        m.observe_load(1 << 20, 1e-3)
        m.observe_prefill(1920, 128, tail * ratio)
    assert m.after_load_factor() == pytest.approx(1.25)
    assert m.prefill is TRUE  # those steps did not feed the prefill fit
    for ratio in (1.2, 1.3):  # five samples: the median
        m.observe_load(1 << 20, 1e-3)
        m.observe_prefill(1920, 128, tail * ratio)
    assert m.after_load_factor() == pytest.approx(1.3)
    m.observe_prefill(0, 512, TRUE.seconds(0, 512))  # a step with no load before it: plain prefill
    assert m.after_load_factor() == pytest.approx(1.3)
    restore = m.restore_seconds(120, 0, 120 * BT + 100)
    assert restore == pytest.approx(m.load_seconds(120, 0) + 1.3 * TRUE.seconds(120 * BT, 100))
    split = m.best_split(0, [True] * 120, 120 * BT + 100)
    assert split.recompute_s == pytest.approx(1.3 * TRUE.seconds(120 * BT, 100))  # decisions see it too
    assert m.restore_seconds(0, 0, 500) == pytest.approx(TRUE.seconds(0, 500))  # nothing loaded: no factor


def test_what_vllm_spends_on_a_request_outside_the_steps_completes_a_ttft_and_decides_nothing():
    m = model(20, 3)
    split_before = m.best_split(0, [True] * 60, 60 * BT + 40)
    for tokens, seconds in ((2048, 2.6e-3), (16384, 20e-3), (8192, 10e-3), (4096, 0.5), (300, 1.0)):
        m.observe_request(tokens, seconds)  # 4096 tokens waited 0.5 s behind another request
    assert m.request_seconds(10_000) == pytest.approx(10_000 * np.percentile([2.6e-3 / 2048, 20e-3 / 16384,
                                                                              10e-3 / 8192, 0.5 / 4096], 25))
    assert m.request_seconds(10_000) < 15e-3  # the queued one does not set the rate
    assert m.best_split(0, [True] * 60, 60 * BT + 40) == split_before
    assert m.restore_seconds(60, 0, 60 * BT + 40) == pytest.approx(
        m.load_seconds(60, 0) + TRUE.seconds(60 * BT, 40) + m.request_seconds(60 * BT + 40))


def test_refreshed_rates_move_the_break_even():
    m = model(12, 1.5, block_bytes=512 << 10)
    before = m.break_even_tokens(True)
    m.refresh_rates(LinkRates(0.2 * GB, 0.05 * GB, nvme_latency_s=1e-4, job_latency_s=3e-4))
    after = m.break_even_tokens(True)
    assert before is not None and (after is None or after > before)


def test_worth_keeping_asks_the_break_even():
    from kvtier.plan.decide import worth_keeping

    fast, crawling = model(12, 1.5, block_bytes=512 << 10), model(0.0005, 0.0005, block_bytes=512 << 10)
    assert worth_keeping(10, None, on_nvme=True)  # no model: a cache keeps what it can
    assert worth_keeping(10, model(1, 1, prefill=None), on_nvme=True)
    assert worth_keeping(0, crawling, on_nvme=True)  # unknown prefix length: kept
    assert not worth_keeping(1 << 20, crawling, on_nvme=True)  # never pays
    be = fast.break_even_tokens(True)
    assert not worth_keeping(be - 1, fast, on_nvme=True) and worth_keeping(be, fast, on_nvme=True)


def test_demotion_drops_sessions_whose_restore_would_lose_to_recompute(fingerprint, hbm, tmp_path):
    """Under DRAM pressure a long session goes to NVMe, a short one below the NVMe break-even is
    dropped (not written), and one pinned to NVMe is written whatever the model says."""
    from support.engine import make_engine

    from kvtier.plan.index import IN_NVME, Tier, chain_block_hashes, namespace_of

    geometry = fingerprint.geometry
    # 1 ms to read a block from NVMe, and attention-bound prefill: two blocks restore slower than
    # they recompute, ten faster
    quadratic = PrefillModel(overhead_s=0.0, per_token_s=0.0, attention_s=1e-6)
    m = model(1000, geometry.block_bytes / 1e-3 / GB, prefill=quadratic, block_bytes=geometry.block_bytes)
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=16, nvme_blocks=32, cost=m)
    be = m.break_even_tokens(True)
    assert be is not None and 2 * BT < be <= 10 * BT, be
    ns = namespace_of(fingerprint.digest)
    tokens = list(range(10 * BT))
    long_keys = chain_block_hashes(tokens, BT)
    short_keys = chain_block_hashes([7] * 2 * BT, BT)
    pinned_keys = chain_block_hashes([9] * 2 * BT, BT)
    engine.store("long", ns, long_keys, list(range(10)), num_tokens=10 * BT)
    engine.store("short", ns, short_keys, [10, 11], num_tokens=2 * BT)
    engine.store("pinned", ns, pinned_keys, [12, 13], num_tokens=2 * BT)
    engine.pin("pinned", Tier.NVME)
    index = engine.manager.table.index
    assert [int(index.col["reach"][index.row_of(ns, k)]) for k in short_keys] == [2 * BT] * 2
    assert int(index.col["reach"][index.row_of(ns, long_keys[0])]) == 10 * BT
    engine.manager.pressure.low = 0.0  # pressure: every DRAM block must go
    engine.maintain(force=True)
    flags = index.col["flags"]
    assert all(flags[index.row_of(ns, k)] & IN_NVME for k in long_keys)
    assert all(flags[index.row_of(ns, k)] & IN_NVME for k in pinned_keys)
    assert all(index.row_of(ns, k) is None for k in short_keys)  # dropped, never written
    assert engine.manager.telemetry.counters["demote_unprofitable_blocks"] == 2
    engine.store("short", ns, short_keys, [10, 11], num_tokens=2 * BT)
    engine.evict("short", Tier.NVME)  # an operator's explicit demotion is carried out as asked
    assert all(flags[index.row_of(ns, k)] & IN_NVME for k in short_keys)
    engine.close(write_back=False)


def test_equal_sized_steps_fold_the_overhead_into_the_per_token_cost():
    """Full prefill chunks only (all 512 tokens): overhead and per-token cost are collinear. The fit
    must not invent a large fixed cost that would make a short tail look expensive."""
    def slow(s: int, n: int) -> float:  # a real fixed cost of 0.5 s per step
        return 0.5 + 50e-6 * n + 2e-9 * (n * s + n * n / 2)

    noisy = [(s, 512, slow(s, 512) * (1.05 if s % 1024 else 0.95)) for s in range(0, 8192, 512)]
    fitted = PrefillModel.fit(noisy)
    assert fitted.overhead_s == 0.0
    tail = fitted.seconds(8192, 128)
    assert tail <= slow(8192, 128)  # under-predicted: errs towards recomputing
    assert fitted.seconds(4096, 512) == pytest.approx(slow(4096, 512), rel=0.15)


def test_rate_refresh_waits_for_a_quiet_engine_but_not_forever(monkeypatch):
    """The link re-measurement waits until the engine has been idle for quiet_s; if it never is,
    it gives up after patience_s (False), and shutting down ends the wait (None). On a fake clock:
    waiting on ``stopping`` moves it on."""
    import types

    from support.clock import FakeClock

    from kvtier.plugins.vllm import timing

    clock = FakeClock()
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(monotonic=clock))

    class Stopping:  # threading.Event.wait on the fake clock; set at ``stop_at``
        def __init__(self, stop_at: float = float("inf")):
            self.stop_at = stop_at

        def wait(self, timeout: float) -> bool:
            if clock() + timeout >= self.stop_at:
                clock.now = max(clock.now, self.stop_at)
                return True
            clock.advance(timeout)
            return False

    quiet_from = [float("inf")]  # the engine steps every 20 ms until then

    def idle_for() -> float:
        return 0.01 if clock() < quiet_from[0] else clock() - quiet_from[0]

    t0 = clock()
    assert timing.wait_until_quiet(idle_for, Stopping(), quiet_s=0.2, patience_s=0.5) is False
    assert clock() - t0 >= 0.5  # it did wait its patience out
    t0 = clock()
    quiet_from[0] = t0 + 0.3  # the engine goes quiet after 0.3 s
    assert timing.wait_until_quiet(idle_for, Stopping(), quiet_s=0.2, patience_s=5.0) is True
    waited = clock() - t0
    assert 0.5 - 1e-9 <= waited < 0.6  # once the engine went quiet and stayed so for quiet_s, not later
    assert timing.wait_until_quiet(lambda: 0.0, Stopping(clock() + 0.1), quiet_s=0.2, patience_s=5.0) is None


def test_a_link_measured_slower_than_the_loads_learned_counts_at_once():
    """The loads taught the model 2 GB/s; a re-measurement (or a cap) then finds the link crawling:
    a prediction never assumes the link faster than it was last measured."""
    m = model(20, 3)
    m.observe_load(1 << 20, 3e-4 + (1 << 20) / (2 * GB))
    learned = m.load_seconds(10, 0)
    m.refresh_rates(m.rates.capped({"pcie": 1e-6}))  # 1 KB/s
    assert m.load_seconds(10, 0) > 1000 * learned
    assert m.break_even_tokens(from_nvme=False) is None
