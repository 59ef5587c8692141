"""Needle in a haystack through vLLM, per codec, on a model that retrieves.

Two models do the same task (a haystack of filler words holding ``KEY k v1 v2`` records; ``KEY k``
asks for ``v1 v2``): ``constructed`` (:mod:`benchmarks.quality.constructed`: a two-layer induction circuit
whose weights are set, not trained, so it retrieves at any length up to 128k tokens, and whose keys
carry outlier channels and an attention sink as real models' do) and ``trained``
(:mod:`benchmarks.quality.retrieval`: trained here, reliable up to 4k). For each context length,
``haystacks`` fresh haystacks (an evaluation seed stream) each hold one record at every depth of
``DEPTHS``. One in-process vLLM engine with kvtier (warm tier uncompressed, an NVMe cold tier):

1. the haystack is prefilled once and stored (raw, in DRAM), and snapshotted;
2. the model is asked for every record on that full-precision KV (``direct``: the model's own
   accuracy, no tier in the way);
3. per codec: the session is dropped everywhere and vLLM's prefix cache reset, the snapshot is
   restored into DRAM (raw), evicted to NVMe (re-encoded by the codec), the prefix cache reset again,
   and every record is asked for: the first question loads the haystack from NVMe through the
   codec's decoder (the bench checks that it did, ``check_loaded``: a codec with fewer blocks loaded
   than the haystacks' full blocks refuses the figures; ``_loaded_blocks``), the next ones find that
   decoded KV in vLLM's prefix cache. Only the haystack's last partial block and the question are
   computed in full precision.

On the constructed model the codecs include ``int4-naive`` (:mod:`benchmarks.quality.naive_codec`: one
scale per tensor, the failure the seed warns of), stored through the same tier as a reference.
A trial is right when both value tokens come back exactly (greedy).
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["DEPTHS", "NEEDLE_CODECS", "NEEDLE_LENGTHS", "NEEDLE_MODELS", "check_loaded", "check_needle_lengths",
           "key_prefix", "run_model_needle"]

NEEDLE_CODECS = ("none", "fp8", "int8", "int4", "int4-lc", "int4-lc+zstd")
NEEDLE_MODELS = ("constructed", "trained")
# default lengths per model: (full run, --quick)
NEEDLE_LENGTHS = {"constructed": ((4096, 16384, 65536, 131072), (4096, 32768)),
                  "trained": ((1024, 2048, 4096, 8192), (1024, 4096))}
DEPTHS = (0.05, 0.25, 0.5, 0.75, 0.95)
EVAL_SEED = 2026  # the benchmark's seed; the model trained on seed stream 0, evaluation draws from stream 1
MARGIN_TOKENS = 64  # the engine's max_model_len: the longest haystack + the question + the answer
DRAM_BYTES = 1 << 30  # the warm tier of the benchmark's engine
ENGINE_BYTES = 3 << 30  # vLLM's own process, weights, prefill workspace (4096-token chunks): measured < 2.5 GiB


def key_prefix(kind: str) -> str:
    """The JSON key prefix of a model's needle figures (``constructed_needle_acc_128k``)."""
    return "constructed_needle_acc_" if kind == "constructed" else "model_needle_acc_"


def _model_shape(kind: str) -> tuple[str, int, int]:
    """(name, max positions, KV bytes per token in bf16) of a needle model, without building it."""
    if kind == "constructed":
        from benchmarks.quality.constructed import constructed_model_dir, geometry

        g = geometry()
        return constructed_model_dir().name, g["max_positions"], g["layers"] * g["kv_heads"] * g["head_dim"] * 4
    from benchmarks.quality.retrieval import GEOMETRY, MAX_POSITIONS, retrieval_model_dir

    g = GEOMETRY
    return retrieval_model_dir().name, MAX_POSITIONS, g["layers"] * g["kv_heads"] * (g["hidden"] // g["heads"]) * 4


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_needle_lengths(kind: str, lengths: Sequence[int], available: int | None = None) -> None:
    """Refuse, before any model is built or engine started, lengths the model cannot take (past its
    positions) or this box cannot hold: vLLM's KV cache (``VLLM_CPU_KVCACHE_SPACE``, 4 GiB by default
    here) must hold the longest haystack, and the engine, that cache, the warm tier and the
    snapshot's copies must fit the memory available now (``available``: bytes, read if None)."""
    from kvtier.codecs.recall import length_label
    from kvtier.errors import UsageError
    from kvtier.units import human_bytes as fmt_bytes

    name, positions, per_token = _model_shape(kind)
    longest = max(lengths)
    if longest + MARGIN_TOKENS > positions:
        raise UsageError(f"context length {length_label(longest)} ({longest:,} tokens) is beyond the {kind} model's "
                         f"max_model_len ({name}: {positions:,} positions, {MARGIN_TOKENS} kept for the question)",
                         hint=f"use lengths in tokens up to {positions - MARGIN_TOKENS:,}, e.g. 4k,32k,128k")
    try:
        kv_space = int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")) * (1 << 30))
    except ValueError:
        raise UsageError(f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']!r} is not a number",
                         hint="set it in GiB, e.g. VLLM_CPU_KVCACHE_SPACE=4") from None
    if (longest + MARGIN_TOKENS) * per_token > kv_space:
        raise UsageError(f"a {longest:,}-token haystack needs {fmt_bytes((longest + MARGIN_TOKENS) * per_token)} of "
                         f"vLLM KV cache; VLLM_CPU_KVCACHE_SPACE gives {fmt_bytes(kv_space)}",
                         hint="raise VLLM_CPU_KVCACHE_SPACE (GiB) or use shorter --needle-lengths (tokens)")
    need = ENGINE_BYTES + kv_space + DRAM_BYTES + 3 * longest * per_token  # + the haystack's DRAM and snapshot copies
    have = _available_bytes() if available is None else available
    if need > have:
        raise UsageError(f"a {longest:,}-token needle run needs about {fmt_bytes(need)} of memory; "
                         f"{fmt_bytes(have)} is available now",
                         hint="free memory, lower VLLM_CPU_KVCACHE_SPACE (GiB) or use shorter "
                              "--needle-lengths (tokens)")


def check_loaded(loaded: dict[str, list[int]] | dict[str, tuple[int, int]]) -> None:
    """Refuse the figures (``FigureRefused``) unless every codec's haystacks were loaded through its
    decoder: ``loaded`` is {codec: (blocks loaded from NVMe, blocks expected)}. A codec with fewer
    loaded than expected (none expected counts as none loaded) answered from KV that never went
    through it, and its accuracy would be the full-precision model's."""
    from kvtier.bench.checks import require

    short = {spec: (got, want) for spec, (got, want) in loaded.items() if not got >= want > 0}
    require(not short, "the needle figures are refused: " + ", ".join(
                f"{spec} loaded {got:,} of {want:,} blocks from NVMe" for spec, (got, want) in short.items()),
            hint="a codec whose loads did not happen would be recorded at full-precision accuracy; "
                 "see the engine's log for the failed loads (always_load must be on)")


def _ask(engine, stack, which: int) -> bool:
    out = engine.generate(stack.question(which), 2)
    return list(out.outputs[0].token_ids) == stack.answer(which)


def _run_job(engine, job) -> None:
    if job is not None:
        engine.run_job(job)


def run_model_needle(lengths: Sequence[int], haystacks: int, codecs: Sequence[str] | None = None,
                     seed: int = EVAL_SEED, progress: Callable[[str], None] = print,
                     model: str | None = None, kind: str = "trained") -> dict:
    """Per codec: {"<prefix><len>": accuracy} (``key_prefix(kind)``); plus the run's lengths,
    trials, wall time and the model's record. ``kind``: ``constructed`` or ``trained``; ``model``: a
    model directory of that kind (default: the cached one, built first if missing). ``codecs``
    default to ``NEEDLE_CODECS``, plus the ``int4-naive`` reference on the constructed model."""
    import numpy as np

    from benchmarks.quality.retrieval import EVAL_STREAM, make_haystack
    from kvtier.bench.harness import Engine, cpu_environment
    from kvtier.codecs import resolve_codec
    from kvtier.codecs.recall import length_label
    from kvtier.persist.snapshot import open_snapshot
    from kvtier.plan.index import Tier
    from kvtier.plugins.vllm.scheduler import anonymous_session

    cpu_environment()
    started = time.perf_counter()
    model = model or str(_ensure_model(kind, progress))
    if codecs is None:
        codecs = NEEDLE_CODECS + (("int4-naive",) if kind == "constructed" else ())
    if "int4-naive" in codecs:
        from benchmarks.quality.naive_codec import register

        register()
    prefix = key_prefix(kind)
    hits: dict[str, dict[int, list[int]]] = {c: {n: [0, 0] for n in lengths} for c in ("direct", *codecs)}
    loaded: dict[str, list[int]] = {c: [0, 0] for c in codecs}  # blocks loaded from NVMe, blocks expected
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-needle-", dir=Path.cwd()) as tmp:
        engine = Engine(str(model), kvtier=True, nvme_dir=Path(tmp) / "nvme", max_len=max(lengths) + MARGIN_TOKENS,
                        max_batched=4096, dram_bytes=DRAM_BYTES, extra={"measure_links": False, "always_load": True})
        manager = engine.manager
        block = manager.geometry.block_tokens
        try:
            for length in lengths:
                for h in range(haystacks):
                    rng = np.random.default_rng([seed, EVAL_STREAM, length, h])
                    stack = make_haystack(rng, length, depths=DEPTHS)
                    t0 = time.perf_counter()
                    engine.generate(stack.tokens, 1)  # prefill and store (raw)
                    _wait_stored(engine, stack.tokens, length // block)
                    session = anonymous_session(manager.block_keys(stack.tokens[:block], None)[0])
                    snap = Path(tmp) / f"h{length}-{h}.kvsnap"
                    _run_job(engine, manager.planner.prepare_snapshot(session, str(snap)))
                    for which in range(len(DEPTHS)):
                        _tally(hits["direct"][length], _ask(engine, stack, which))
                    progress(f"{length_label(length)} haystack {h + 1}/{haystacks}: prefilled in "
                             f"{time.perf_counter() - t0:.1f} s, direct {hits['direct'][length]}")
                    for spec in codecs:
                        _run_job(engine, manager.planner.evict(session, None))
                        engine.forget_hbm()
                        _run_job(engine, manager.planner.prepare_restore(open_snapshot(snap)))
                        manager.table.cold_codec = resolve_codec(spec, manager.geometry, "cold")
                        _run_job(engine, manager.planner.evict(session, Tier.NVME))
                        engine.forget_hbm()
                        before = manager.telemetry.counters.get("hit_nvme_blocks", 0)
                        for which in range(len(DEPTHS)):
                            _tally(hits[spec][length], _ask(engine, stack, which))
                        loaded[spec][0] += manager.telemetry.counters.get("hit_nvme_blocks", 0) - before
                        loaded[spec][1] += length // block
                    snap.unlink()
                    _run_job(engine, manager.planner.evict(session, None))
                    engine.forget_hbm()
                summary = ", ".join(f"{c} {hits[c][length][0]}/{hits[c][length][1]}" for c in hits)
                progress(f"{length_label(length)}: {summary}")
                check_loaded(loaded)  # each length: a run whose loads stopped fails before the next
        finally:
            engine.close()
    results = {}
    for spec, per_length in hits.items():
        entry = {f"{prefix}{length_label(n)}": round(right / total, 4)
                 for n, (right, total) in per_length.items()}
        if spec in loaded:
            entry["_loaded_blocks"], entry["_expected_blocks"] = loaded[spec]
        results[spec] = entry
    return {"per_codec": results, "_lengths": list(lengths), "_trials_per_length": haystacks * len(DEPTHS),
            "_depths": list(DEPTHS), "_haystacks_per_length": haystacks, "_seed": seed,
            "_wall_s": round(time.perf_counter() - started, 1), "_model": str(model), "_model_kind": kind,
            **_model_record(kind, model)}


def _ensure_model(kind: str, progress: Callable[[str], None]):
    if kind == "constructed":
        from benchmarks.quality.constructed import ensure_constructed_model

        return ensure_constructed_model(progress=progress)
    from benchmarks.quality.retrieval import ensure_retrieval_model

    return ensure_retrieval_model(progress=progress)


def _model_record(kind: str, model: str) -> dict:
    """What the JSON says of the model: how it was made and what HF measured on it; for the
    constructed model, its key statistics (outlier channels, sink) too."""
    if kind == "constructed":
        from benchmarks.quality.constructed import constructed_info

        info = constructed_info(model) or {}
        return {"_model_construction": info.get("params"), "_model_hf_accuracy": info.get("hf_accuracy"),
                "_model_key_statistics": info.get("key_statistics")}
    from benchmarks.quality.retrieval import model_info

    info = model_info(model) or {}
    return {"_model_training": info.get("training"), "_model_hf_accuracy": info.get("hf_accuracy")}


def _wait_stored(engine, tokens: list[int], blocks: int, timeout_s: float = 120.0) -> None:
    """Step the engine until the haystack's ``blocks`` full blocks are in the index (stores finish
    a step or more after the request)."""
    from kvtier.plan.index import namespace_of

    manager = engine.manager
    keys = manager.block_keys(tokens[: blocks * manager.geometry.block_tokens], None)
    namespace = namespace_of(manager.fingerprint.digest)
    deadline = time.monotonic() + timeout_s
    while len(manager.table.peek(namespace, keys)) < blocks:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the haystack's {blocks} blocks were not stored in {timeout_s:.0f} s")
        engine.generate([7, 8, 9], 1)


def _tally(counts: list[int], right: bool) -> None:
    counts[0] += int(right)
    counts[1] += 1


def run_in_child(lengths: Sequence[int], haystacks: int, progress: Callable[[str], None] = print,
                 kind: str = "trained") -> dict:
    """``run_model_needle`` in a child process: one vLLM engine per process, and the codecs' numba
    kernels (compiled at the first decode) must not be loaded when a later engine of this process
    starts (docs/codecs.md: the kernel-override trap). Progress lines stream through; figures the
    child refused (``check_loaded``) are refused here too, in the child's words."""
    import json
    import subprocess
    import sys

    from kvtier.bench.checks import FigureRefused
    from kvtier.errors import KvtierError

    cmd = [sys.executable, "-m", "benchmarks.quality.needle", ",".join(map(str, lengths)), str(haystacks), kind]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None and proc.stdout is not None
    tail: list[str] = []
    refused = None
    for line in proc.stderr:
        line = line.rstrip()
        if line.startswith("PROGRESS "):
            progress(line[len("PROGRESS "):])
        elif line.startswith("REFUSED "):
            refused = json.loads(line[len("REFUSED "):])
        elif line:
            tail = (tail + [line])[-20:]
    out = proc.stdout.read()
    if proc.wait() != 0 and refused is not None:
        raise FigureRefused(refused["message"], hint=refused.get("hint"))
    if proc.returncode != 0:
        raise KvtierError("the model needle benchmark failed:\n" + "\n".join(tail),
                          hint=f"run `python -m benchmarks.quality.needle 1024 1 {kind}` to see it alone")
    return json.loads(out)


if __name__ == "__main__":  # python -m benchmarks.quality.needle LENGTHS HAYSTACKS [KIND]
    import contextlib
    import json
    import sys

    def _say(msg: str) -> None:
        print(f"PROGRESS {msg}", file=sys.stderr, flush=True)

    from kvtier.bench.checks import FigureRefused

    try:
        with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout; stdout is for the result
            result = run_model_needle([int(n) for n in sys.argv[1].split(",")], int(sys.argv[2]), progress=_say,
                                      kind=sys.argv[3] if len(sys.argv) > 3 else "trained")
    except FigureRefused as exc:  # the parent refuses it in these words (run_in_child)
        print("REFUSED " + json.dumps({"message": exc.message, "hint": exc.hint}), file=sys.stderr, flush=True)
        sys.exit(1)
    print(json.dumps(result))
