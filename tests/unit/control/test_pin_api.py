"""The admin API's timed pin (``POST /v1/sessions/S/pin {"tier": ..., "for_s": N}``) and the time
limits in its session views, over a real Unix socket to an in-process engine (``LocalAdmin``) whose
wall clock the test moves."""
from __future__ import annotations

import pytest
from support.clock import FakeClock
from support.engine import make_engine

from kvtier.control.client import AdminClient
from kvtier.control.local import LocalAdmin
from kvtier.errors import UsageError
from kvtier.plan.index import Tier, chain_block_hashes, namespace_of


@pytest.fixture
def served(fingerprint, hbm, tmp_path):
    clock = FakeClock(1_700_000_000.0)
    engine = make_engine(fingerprint, hbm, tmp_path, dram_blocks=16, nvme_blocks=16, wall_clock=clock)
    ns = namespace_of(fingerprint.digest)
    engine.store("agent", ns, chain_block_hashes(list(range(64)), 16), [0, 1, 2, 3], num_tokens=64)
    admin = LocalAdmin(engine, tmp_path / "a.sock").start()
    try:
        yield AdminClient(str(tmp_path / "a.sock")), admin, clock
    finally:
        admin.stop()
        engine.close(write_back=False)


def test_a_pin_for_a_while_is_shown_and_ends(served):
    client, admin, clock = served
    job = client.post(AdminClient.session_path("agent", "pin"), {"tier": "nvme", "for_s": 1800})
    assert job["pin_expires_at"] == clock.now + 1800
    admin.drain()
    listed = client.get("/v1/sessions")["sessions"][0]
    assert (listed["pinned"], listed["pin_expires_at"], listed["pin_left_s"]) == ("nvme", clock.now + 1800, 1800)
    clock.advance(600)
    assert client.get("/v1/sessions/agent")["pin_left_s"] == 1200
    clock.advance(1200)
    with admin.lock:  # what the connector's periodic pass does (maintenance, or its catalog thread)
        admin.engine.manager.planner.expire()
    doc = client.get("/v1/sessions/agent")
    assert (doc["pinned"], doc["pin_left_s"], doc["state"]) == (None, None, "warm")


def test_a_pin_without_for_s_has_no_end(served):
    client, admin, clock = served
    job = client.post(AdminClient.session_path("agent", "pin"), {"tier": "dram"})
    assert job["pin_expires_at"] is None
    admin.drain()
    assert admin.engine.manager.table.session("agent").pinned == Tier.DRAM
    assert client.get("/v1/sessions/agent")["pin_left_s"] is None


@pytest.mark.parametrize("for_s", [0, -30, "30m", True, [5], 1e12])
def test_a_pin_for_no_time_or_not_a_number_is_a_400_with_a_hint(served, for_s):
    client, admin, _ = served
    with pytest.raises(UsageError, match="for_s must be a number of seconds") as caught:
        client.post(AdminClient.session_path("agent", "pin"), {"tier": "dram", "for_s": for_s})
    assert "for_s" in (caught.value.hint or "")
    assert admin.engine.manager.table.session("agent").pinned is None  # nothing was planned


def test_a_retention_hint_is_shown_while_live(served):
    client, admin, clock = served
    with admin.lock:  # as the connector does for a request that carries the hint
        admin.engine.manager.planner.retain("agent", 600, 2)
    doc = client.get("/v1/sessions/agent")
    assert (doc["retain_left_s"], doc["retain_priority"], doc["retain_expires_at"]) == (600, 2, clock.now + 600)
    clock.advance(601)
    doc = client.get("/v1/sessions/agent")
    assert (doc["retain_left_s"], doc["retain_priority"]) == (None, None)
