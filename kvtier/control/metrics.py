"""``GET /metrics``: the engine's counters, tiers, sessions and job latencies as Prometheus text."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.control.api import STATES

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.control.ops import Ops

__all__ = ["metrics"]


def _turn_metrics(counters: dict, family) -> list:
    """Turns by reason (kvtier.plan.reasons): every turn, the misses among them, and the prompt tokens
    vLLM recomputed in them. Every reason is listed, at 0 until it happens."""
    from kvtier.plan.reasons import HIT_REASONS, REASONS

    turns = family("kvtier_turns", "Admitted requests, by what kvtier found (kvtier inspect explains each)",
                   labels=["reason"])
    misses = family("kvtier_misses", "Admitted requests that recomputed servable prompt tokens, by why",
                    labels=["reason"])
    tokens = family("kvtier_recompute_tokens", "Prompt tokens vLLM recomputed, by the turn's reason",
                    labels=["reason"])
    for reason in REASONS:
        turns.add_metric([reason], counters.get(f"turns_{reason}", 0))
        if reason not in HIT_REASONS:
            misses.add_metric([reason], counters.get(f"turns_{reason}", 0))
        tokens.add_metric([reason], counters.get(f"recomputed_tokens_{reason}", 0))
    return [turns, misses, tokens]


def metrics(ops: "Ops") -> bytes:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

    with ops.lock:
        stats = ops.manager.views.stats()
        states = ops.manager.views.session_state_counts()
        latency = {kind: list(values) for kind, values in ops.latency.items()}
        link_bytes = ops.link_bytes()
    counters = stats["counters"]

    class Collector:
        def collect(self):
            used = GaugeMetricFamily("kvtier_tier_bytes", "Bytes held per tier", labels=["tier"])
            cap = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Capacity per tier", labels=["tier"])
            blocks = GaugeMetricFamily("kvtier_tier_blocks", "Blocks held per tier", labels=["tier"])
            for tier in ("dram", "nvme"):
                used.add_metric([tier], stats[tier]["used_bytes"])
                cap.add_metric([tier], stats[tier]["capacity_bytes"])
                blocks.add_metric([tier], stats[tier]["blocks"])
            yield from (used, cap, blocks)
            hits = CounterMetricFamily("kvtier_hit_blocks", "Blocks loaded into HBM, by source tier", labels=["tier"])
            for tier in ("dram", "nvme"):
                hits.add_metric([tier], counters.get(f"hit_{tier}_blocks", 0))
            yield hits
            tokens = CounterMetricFamily("kvtier_loaded_tokens", "Prompt tokens loaded instead of recomputed")
            tokens.add_metric([], counters.get("loaded_tokens", 0))
            yield tokens
            links = CounterMetricFamily("kvtier_link_bytes", "Bytes moved per link", labels=["link"])
            for link, value in sorted(link_bytes.items()):
                links.add_metric([link], value)
            yield links
            sessions = GaugeMetricFamily("kvtier_sessions", "Sessions by state", labels=["state"])
            for state in STATES:
                sessions.add_metric([state], states[state])
            yield sessions
            jobs = SummaryMetricFamily("kvtier_job_seconds", "Job latency", labels=["kind"])
            for kind, values in sorted(latency.items()):
                jobs.add_metric([kind], len(values), sum(values))
            yield jobs
            yield from _turn_metrics(counters, CounterMetricFamily)
            decisions = CounterMetricFamily("kvtier_load_decisions", "Admitted requests with a stored hit, by "
                                            "what the cost model chose", labels=["decision"])
            for decision in ("load", "split", "recompute"):
                decisions.add_metric([decision], counters.get(f"decision_{decision}", 0))
            yield decisions
            dirty = stats["dirty"]
            yield GaugeMetricFamily("kvtier_dirty_bytes", "DRAM bytes with no NVMe copy yet (a crash loses them)",
                                    value=dirty["dirty_bytes"])
            yield GaugeMetricFamily("kvtier_dirty_blocks", "DRAM blocks with no NVMe copy yet",
                                    value=dirty["dirty_blocks"])
            yield GaugeMetricFamily("kvtier_dirty_age_seconds", "Age of the oldest DRAM block with no NVMe copy",
                                    value=dirty["dirty_age_s"])
            written = CounterMetricFamily("kvtier_durable_blocks", "Blocks given an NVMe copy while kept in DRAM",
                                          labels=["how"])
            written.add_metric(["write_behind"], counters.get("written_behind_blocks", 0))
            written.add_metric(["flush"], counters.get("flushed_blocks", 0))
            yield written
            warn = GaugeMetricFamily("kvtier_warning", "1 while a tier has a warning", labels=["tier"])
            for tier in ("dram", "nvme"):  # "nvme" also covers "nvme_reads" (blocks lost or damaged)
                warn.add_metric([tier], 1 if any(k.split("_")[0] == tier for k in stats["warnings"]) else 0)
            yield warn

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return generate_latest(registry)
