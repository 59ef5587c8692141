"""Every figure the docs show, with its target: what ``python -m benchmarks.render`` reads from the
results of ``python -m benchmarks record`` and judges.

A ``Figure`` names a value in a benchmark's JSON (``key``; ``/`` goes into nested objects: the quality
bench's ``fp8/top1_agreement``), says what it is, and holds its target: ``(op, bound)`` with op one of
``<=``, ``>=``, ``==``, the bound a number or another figure's key plus an offset
(``(">=", "none/constructed_needle_acc_128k", -0.01)``: within one point of the uncompressed codec);
``None`` for a context figure, shown and never judged. ``SECTIONS`` groups them by benchmark in the
order docs/benchmarks.md shows them; ``headline`` marks those the summary and the README show.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

__all__ = ["Figure", "SECTIONS", "Section", "Target", "judge", "lookup"]

Target = Union[tuple[str, float], tuple[str, str, float], None]


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    target: Target = None
    headline: bool = False


@dataclass(frozen=True)
class Section:
    """One benchmark's figures: ``name`` is its recorded name (``benchmarks.record.RUNS``)."""

    name: str
    question: str
    figures: tuple[Figure, ...]


def lookup(results: dict, key: str) -> Any:
    """The value at ``key`` (``a/b`` for nested objects), None when absent."""
    value: Any = results
    for part in key.split("/"):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def bound_of(target: Target, results: dict) -> float | None:
    """A target's bound as a number (a reference figure's value plus its offset), None if unknown."""
    if target is None:
        return None
    if len(target) == 3:
        reference = lookup(results, target[1])
        return None if not isinstance(reference, (int, float)) else reference + target[2]
    return float(target[1])


def judge(figure: Figure, results: dict) -> str:
    """``met``, ``missed``, ``context`` (no target) or ``not measured``."""
    value = lookup(results, figure.key)
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)):
        return "not measured"
    if figure.target is None:
        return "context"
    bound = bound_of(figure.target, results)
    if bound is None:
        return "not measured"
    op = figure.target[0]
    ok = value <= bound + 1e-12 if op == "<=" else value >= bound - 1e-12 if op == ">=" else abs(value - bound) < 1e-9
    return "met" if ok else "missed"


def F(key: str, label: str, target: Target = None, headline: bool = False) -> Figure:  # noqa: N802 - a table row
    return Figure(key, label, target, headline)


ZERO = ("==", 0)
ONE = ("==", 1)

SECTIONS: tuple[Section, ...] = (
    Section("tiers", "How fast are the tiers, against memcpy and raw O_DIRECT IO?", (
        F("dram_put_vs_memcpy", "DRAM put vs memcpy", (">=", 0.8)),
        F("dram_get_vs_memcpy", "DRAM get vs memcpy", (">=", 0.8)),
        F("nvme_write_vs_raw_64k", "NVMe write vs raw, 64 KiB blocks", (">=", 0.8), True),
        F("nvme_read_vs_raw_64k", "NVMe read vs raw, 64 KiB blocks", (">=", 0.8)),
        F("nvme_write_vs_raw_2m", "NVMe write vs raw, 2 MiB blocks", (">=", 0.9), True),
        F("nvme_read_vs_raw_2m", "NVMe read vs raw, 2 MiB blocks", (">=", 0.9), True),
        F("files_per_gib_64k", "files per GiB of 64 KiB blocks", ("<=", 16)),
        F("snapshot_write_vs_raw", "snapshot write vs raw", (">=", 0.7)),
        F("snapshot_read_vs_raw", "snapshot read vs raw", (">=", 0.8)),
        F("lookup_1024_blocks_ms", "lookup of a 1,024-block prefix at 1M blocks, ms", ("<=", 0.5)),
        F("index_bytes_per_block", "index bytes per block at 1M blocks", ("<=", 256)),
    )),
    Section("restore", "Is a GB-scale session back from NVMe at the disk's speed?", (
        F("restore_vs_raw", "70B-shaped session restored, verified, vs raw O_DIRECT read", (">=", 0.9), True),
        F("core_s_per_gib", "CPU per GiB restored, core-s", ("<=", 0.08), True),
        F("xxh3_core_s_per_gib", "xxh3 alone per GiB, core-s (the floor of the above)"),
        F("extra_rss_mib", "extra RSS during the restore, MiB", ("<=", 256)),
        F("tmpfs_vs_memcpy", "restore from RAM (tmpfs) vs memcpy", (">=", 0.5)),
        F("two_dirs_vs_one", "two directories vs one (one disk)", (">=", 0.95)),
    )),
    Section("serve", "Does a restore beat recompute, and what does kvtier cost while serving?", (
        F("restore_vs_recompute_ttft_4k", "restored vs recomputed TTFT, 4k tokens"),
        F("restore_vs_recompute_ttft_16k", "restored vs recomputed TTFT, 16k tokens (--quick: a second 4k)",
          ("<=", 0.05), True),
        F("decode_with_vs_without", "decode rate with vs without kvtier", (">=", 0.99), True),
        F("prefill_store_overhead", "prefill store overhead", ("<=", 0.02)),
        F("tp2_outputs_identical", "TP=2: outputs identical to plain vLLM", ONE),
        F("tp2_restore_vs_recompute_ttft", "TP=2: restored vs recomputed TTFT", ("<=", 0.1)),
    )),
    Section("costmodel", "Does the cost model choose right between loading and recomputing?", (
        F("max_rel_error_restore", "worst relative error, restore TTFT (2k/8k/16k)", ("<=", 0.30), True),
        F("max_rel_error_recompute", "worst relative error, recompute TTFT", ("<=", 0.30)),
        F("capped_link_ttft_vs_recompute", "on a capped link: TTFT vs a plain recompute", ("<=", 1.10), True),
    )),
    Section("agents", "How much sooner does an agent's turn start?", (
        F("r1_ttft_p50_vs_vllm", "regime 1 (nothing to load): TTFT p50 vs plain vLLM", ("<=", 1.05)),
        F("r1_ttft_p99_vs_vllm", "regime 1: TTFT p99 vs plain vLLM", ("<=", 1.05)),
        F("r2_ttft_p50_vs_vllm", "regime 2 (DRAM serves): TTFT p50 vs plain vLLM", ("<=", 0.10)),
        F("r2_ttft_p99_vs_vllm", "regime 2: TTFT p99 vs plain vLLM", ("<=", 0.25)),
        F("r2_recomputed_vs_vllm", "regime 2: prefill tokens recomputed vs plain vLLM", ("<=", 0.10)),
        F("r2_reprefill_vs_vllm", "regime 2: re-prefill beyond the floor's, vs plain vLLM"),
        F("r3_ttft_p50_vs_vllm", "regime 3 (NVMe serves part): TTFT p50 vs plain vLLM", ("<=", 0.25), True),
        F("r3_resumed_p50_vs_vllm", "regime 3: resumed after a pause, TTFT p50 vs plain vLLM", ("<=", 0.25), True),
        F("r3_wait_p50_vs_vllm", "regime 3: ready to first token p50 vs plain vLLM"),
        F("r2_ttft_p50_vs_floor", "regime 2: turns >= 2 TTFT p50 vs the all-in-HBM floor", ("<=", 1.25)),
        F("r3_ttft_p50_vs_floor", "regime 3: turns >= 2 TTFT p50 vs the floor", ("<=", 1.5)),
        F("itl_p50_vs_vllm_max", "ITL p50 vs plain vLLM, worst regime", ("<=", 1.03)),
        F("itl_p99_vs_vllm_max", "ITL p99 vs plain vLLM, worst regime", ("<=", 1.03)),
        F("first_turn_ttft_p50_vs_vllm_max", "first turns TTFT p50 vs plain vLLM, worst regime", ("<=", 1.03)),
        F("errors", "failed requests", ZERO),
        F("outputs_equal", "determinism pass: outputs equal to plain vLLM's", ONE),
        F("hinted_resumed_p50_vs_unhinted", "hinted sessions resumed vs unhinted, TTFT p50", ("<=", 0.5)),
    )),
    Section("codecs", "What do the codecs cost?", (
        F("fp8_decode_vs_memcpy", "fp8 decode vs memcpy (CPU)", (">=", 0.5), True),
        F("fp8_restore_vs_raw_read", "fp8 cold tier: restore vs the raw read of bf16", (">=", 1.5), True),
        F("int8_decode_vs_memcpy", "int8 decode vs memcpy"),
        F("int8_restore_vs_raw_read", "int8 restore vs raw read"),
        F("int4_decode_vs_memcpy", "int4 decode vs memcpy"),
        F("int4_restore_vs_raw_read", "int4 restore vs raw read"),
        F("int4-lc_decode_vs_memcpy", "int4-lc decode vs memcpy"),
        F("int4-lc_restore_vs_raw_read", "int4-lc restore vs raw read"),
        F("none_restore_vs_raw_read", "uncompressed restore vs raw read"),
        F("fp8+zstd_restore_vs_raw_read", "fp8+zstd restore vs raw read"),
    )),
    Section("quality", "What recall do the codecs keep, to 128k tokens?", (
        F("fp8/size_ratio", "fp8 size vs bf16", ("<=", 0.52), True),
        F("int8/size_ratio", "int8 size vs bf16"),
        F("int4/size_ratio", "int4 size vs bf16", ("<=", 0.30)),
        F("int4-lc/size_ratio", "int4-lc size vs bf16"),
        F("fp8/top1_agreement", "fp8 top-1 agreement through vLLM (demo model)", (">=", 0.99)),
        F("fp8/kl", "fp8 KL through vLLM", ("<=", 1e-3)),
        F("fp8/needle_acc_128k", "fp8 synthetic needle among 128k keys", (">=", 0.999)),
        F("int4-lc/needle_acc_128k", "int4-lc synthetic needle among 128k keys", (">=", 0.99)),
        F("int4/needle_acc_128k", "int4 (KIVI) synthetic needle among 128k keys"),
        F("none/constructed_needle_acc_128k", "uncompressed: model needle at 128k (constructed model)",
          (">=", 0.95), True),
        F("fp8/constructed_needle_acc_128k", "fp8: model needle at 128k",
          (">=", "none/constructed_needle_acc_128k", -0.01), True),
        F("int8/constructed_needle_acc_128k", "int8: model needle at 128k",
          (">=", "none/constructed_needle_acc_128k", -0.01)),
        F("int4-lc/constructed_needle_acc_128k", "int4-lc: model needle at 128k",
          (">=", "none/constructed_needle_acc_128k", -0.01), True),
        F("int4/constructed_needle_acc_128k", "int4: model needle at 128k"),
        F("naive_int4_needle_acc_128k", "naive per-tensor int4: model needle at 128k",
          ("<=", "none/constructed_needle_acc_128k", -0.20), True),
    )),
    Section("restart", "What survives a stop or a SIGKILL?", (
        F("sessions_listed_after_stop", "sessions listed after Ctrl-C", ONE, True),
        F("pins_kept_after_stop", "pins kept after Ctrl-C", ONE),
        F("loaded_after_stop", "next turns loaded after Ctrl-C", ONE),
        F("outputs_identical", "outputs identical after a stop or a SIGKILL", ONE),
        F("loaded_after_sigkill", "full-block tokens loaded after a SIGKILL of every process", ONE, True),
        F("catalog_start_ms_100k_sessions", "catalog of 100k sessions opened at start, ms", ("<=", 500)),
        F("serving_overhead", "prefill throughput lost to write-behind and the catalog", ("<=", 0.02)),
    )),
    Section("faults", "What does the fault suite find?", (
        F("crash_trials", "SIGKILL crash trials", (">=", 200)),
        F("corrupt_loads", "wrong bytes served after the kills", ZERO, True),
        F("corruption_trials", "on-disk corruption trials", (">=", 1000)),
        F("corruption_detected_ratio", "corruptions detected", ONE, True),
        F("failed_requests_under_load", "failed requests through ENOSPC, read-only and wiped disks", ZERO, True),
        F("outputs_mismatched", "outputs unlike plain vLLM's under those faults", ZERO),
        F("dram_budget_exceeded", "DRAM budget overruns", ZERO),
        F("hostile_inputs", "hostile inputs sent"),
        F("hostile_crashes", "crashes on hostile input", ZERO),
        F("poisoning_attempts", "forged snapshots", (">=", 200)),
        F("poisoned_loads", "poisoned loads", ZERO),
        F("accepted_forged", "forged snapshots accepted", ZERO, True),
        F("slot_leaks", "slots leaked by refused restores", ZERO),
        F("path_escapes_tried", "path escapes tried", (">=", 100)),
        F("path_escapes", "path escapes that succeeded", ZERO),
        F("blocked_requests", "requests blocked over 2 s", ZERO),
    )),
    Section("power", "Does what kvtier acknowledged survive a power cut?", (
        F("power_states", "crash states built from recorded IO", (">=", 2000), True),
        F("power_acked_lost", "acknowledged blocks, snapshots or sessions lost", ZERO, True),
        F("power_wrong_bytes", "wrong bytes served after a cut", ZERO, True),
        F("power_start_crashes", "start-ups that failed after a cut", ZERO),
        F("power_catalog_wrong", "catalog rows unlike what was committed", ZERO),
        F("power_window_losses", "block-states lost in the write-behind window (only in DRAM at the cut: "
                                 "not acknowledged durable, counted apart)"),
        F("power_over_budget", "NVMe over its budget after a cut", ZERO),
        F("recorder_off_cpu_ratio", "write path's CPU through the file door vs bare calls", ("<=", 1.02)),
        F("recorder_off_cpu_bound", "the door's own cost per GiB written, bound", ("<=", 0.02)),
    )),
    Section("slow-disk", "Does kvtier notice a disk that turns slow while serving?", (
        F("slow_disk_noticed_after_loads", "loads before the slow disk is noticed", ("<=", 5)),
        F("slow_disk_ttft_vs_recompute_max", "worst TTFT after that vs a recompute", ("<=", 1.1), True),
        F("slow_disk_failed_requests", "failed requests", ZERO),
        F("slow_disk_resume_s", "seconds to trust the disk again once healthy", ("<=", 10)),
    )),
    Section("admin", "How fast is the admin plane under load?", (
        F("p99_ms_under_load", "admin API p99 under vLLM load, ms", ("<=", 5), True),
        F("fuzz_requests", "fuzz requests", (">=", 1000)),
        F("fuzz_crashes", "fuzz crashes", ZERO),
        F("fuzz_accepted_invalid", "invalid requests accepted", ZERO),
    )),
    Section("top", "What does `kvtier top` cost?", (
        F("cpu_percent_one_core", "CPU at a 1 s refresh with 1,000 sessions, % of a core", ("<=", 3), True),
        F("key_latency_ms", "key to screen, ms (median)", ("<=", 100)),
    )),
    Section("scale", "Do the costs stay flat as blocks and sessions grow?", (
        F("startup_s_per_million_blocks", "NVMe start-up per million blocks, s", ("<=", 1.5), True),
        F("ram_bytes_per_block_1m", "host RAM per block at 1M blocks, B", ("<=", 256), True),
        F("lookup_1m_vs_10k", "a cold 1,024-block lookup at 1M vs at 10k blocks", ("<=", 2)),
        F("sessions_json_s_100k", "`kvtier sessions --json` at 100k sessions, s", ("<=", 1)),
        F("top_cpu_percent_100k", "`kvtier top` at 100k sessions, % of a core", ("<=", 3)),
        F("server_startup_s_per_million_blocks", "both halves' start-up per million blocks, s"),
        F("startup_per_block_1m_vs_10k", "start-up per block, 1M vs 10k"),
        F("victims_us_per_block_1m_vs_10k", "victims per block, 1M vs 10k"),
        F("journal_compact_s_per_million_blocks", "journal compaction per million blocks, s"),
        F("catalog_open_s_1m", "a catalog of 1M sessions opened, s"),
        F("largest_blocks", "the largest size measured, blocks"),
    )),
    Section("memory", "Does the DRAM tier cost only its budget in host RAM?", (
        F("rss_excess_mib_max", "server RSS over plain vLLM + 1.05 x the DRAM budget, worst size, MiB",
          ("<=", 256), True),
        F("filled", "DRAM tier filled before measuring", ONE),
    )),
    Section("shared", "Does the shared tier keep up with its own client?", (
        F("shared_put_vs_client_raw", "writes vs plain redis-py SET", (">=", 0.8), True),
        F("shared_get_vs_client_raw", "reads vs plain redis-py GET", (">=", 0.8), True),
        F("cross_box_loaded", "a second box loads what the first published", ONE),
        F("cross_box_outputs_identical", "its outputs identical", ONE),
        F("store_down_failed_requests", "failed requests with the store down", ZERO),
        F("store_down_step_p99_vs_baseline", "step p99 with the store down vs healthy", ("<=", 1.1)),
        F("foreign_values_served", "foreign values served", ZERO),
    )),
)
