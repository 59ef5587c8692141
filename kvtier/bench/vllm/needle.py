"""Needle in a haystack through vLLM, per codec, on a model that has learned to retrieve.

The model is ``kvtier.models.retrieval`` (a small Llama trained here on key-value retrieval). For
each context length, ``haystacks`` fresh haystacks (an evaluation seed stream the model was never
trained on) each hold one record at every depth of ``DEPTHS``. One in-process vLLM engine with
kvtier (warm tier uncompressed, an NVMe cold tier):

1. the haystack is prefilled once and stored (raw, in DRAM), and snapshotted;
2. the model is asked for every record on that full-precision KV (``direct``: the model's own
   accuracy, no tier in the way);
3. per codec: the session is dropped everywhere and vLLM's prefix cache reset, the snapshot is
   restored into DRAM (raw), evicted to NVMe (re-encoded by the codec), the prefix cache reset again,
   and every record is asked for: the first question loads the haystack from NVMe through the
   codec's decoder (the bench checks that it did: ``_loaded_blocks``), the next ones find that
   decoded KV in vLLM's prefix cache. Only the haystack's last partial block and the question are
   computed in full precision.

A trial is right when both value tokens come back exactly (greedy).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["DEPTHS", "NEEDLE_CODECS", "run_model_needle"]

NEEDLE_CODECS = ("none", "fp8", "int8", "int4", "int4-lc", "int4-lc+zstd")
DEPTHS = (0.05, 0.25, 0.5, 0.75, 0.95)
EVAL_SEED = 2026  # the benchmark's seed; the model trained on seed stream 0, evaluation draws from stream 1


def _ask(engine, stack, which: int) -> bool:
    out = engine.generate(stack.question(which), 2)
    return list(out.outputs[0].token_ids) == stack.answer(which)


def _run_job(engine, job) -> None:
    if job is not None:
        engine.run_job(job)


def run_model_needle(lengths: Sequence[int], haystacks: int, codecs: Sequence[str] = NEEDLE_CODECS,
                     seed: int = EVAL_SEED, progress: Callable[[str], None] = print,
                     model: str | None = None) -> dict:
    """Per codec: {"model_needle_acc_<len>": accuracy}; plus the run's lengths, trials, wall time.
    ``model``: a retrieval model directory (default: the cached one, trained first if missing)."""
    import numpy as np

    from kvtier.bench.vllm.harness import Engine, cpu_environment
    from kvtier.codecs import resolve_codec
    from kvtier.codecs.recall import length_label
    from kvtier.models.retrieval import EVAL_STREAM, ensure_retrieval_model, make_haystack, model_info
    from kvtier.persist.snapshot import open_snapshot
    from kvtier.plan.index import Tier
    from kvtier.plugins.vllm.scheduler import anonymous_session

    cpu_environment()
    started = time.perf_counter()
    model = model or str(ensure_retrieval_model(progress=progress))
    hits: dict[str, dict[int, list[int]]] = {c: {n: [0, 0] for n in lengths} for c in ("direct", *codecs)}
    loaded: dict[str, list[int]] = {c: [0, 0] for c in codecs}  # blocks loaded from NVMe, blocks expected
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-needle-", dir=Path.cwd()) as tmp:
        engine = Engine(str(model), kvtier=True, nvme_dir=Path(tmp) / "nvme", max_len=max(lengths) + 64,
                        max_batched=4096, dram_bytes=1 << 30, extra={"measure_links": False, "always_load": True})
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
                    _run_job(engine, manager.prepare_snapshot(session, str(snap)))
                    for which in range(len(DEPTHS)):
                        _tally(hits["direct"][length], _ask(engine, stack, which))
                    progress(f"{length_label(length)} haystack {h + 1}/{haystacks}: prefilled in "
                             f"{time.perf_counter() - t0:.1f} s, direct {hits['direct'][length]}")
                    for spec in codecs:
                        _run_job(engine, manager.evict(session, None))
                        engine.forget_hbm()
                        _run_job(engine, manager.prepare_restore(open_snapshot(snap)))
                        manager.cold_codec = resolve_codec(spec, manager.geometry, "cold")
                        _run_job(engine, manager.evict(session, Tier.NVME))
                        engine.forget_hbm()
                        before = manager.counters.get("hit_nvme_blocks", 0)
                        for which in range(len(DEPTHS)):
                            _tally(hits[spec][length], _ask(engine, stack, which))
                        loaded[spec][0] += manager.counters.get("hit_nvme_blocks", 0) - before
                        loaded[spec][1] += length // block
                    snap.unlink()
                    _run_job(engine, manager.evict(session, None))
                    engine.forget_hbm()
                summary = ", ".join(f"{c} {hits[c][length][0]}/{hits[c][length][1]}" for c in hits)
                progress(f"{length_label(length)}: {summary}")
        finally:
            engine.close()
    results = {}
    for spec, per_length in hits.items():
        entry = {f"model_needle_acc_{length_label(n)}": round(right / total, 4)
                 for n, (right, total) in per_length.items()}
        if spec in loaded:
            entry["_loaded_blocks"], entry["_expected_blocks"] = loaded[spec]
        results[spec] = entry
    info = model_info(model) or {}
    return {"per_codec": results, "_lengths": list(lengths), "_trials_per_length": haystacks * len(DEPTHS),
            "_depths": list(DEPTHS), "_haystacks_per_length": haystacks, "_seed": seed,
            "_wall_s": round(time.perf_counter() - started, 1), "_model": str(model),
            "_model_training": info.get("training"), "_model_hf_accuracy": info.get("hf_accuracy")}


def _wait_stored(engine, tokens: list[int], blocks: int, timeout_s: float = 120.0) -> None:
    """Step the engine until the haystack's ``blocks`` full blocks are in the index (stores finish
    a step or more after the request)."""
    from kvtier.plan.index import namespace_of

    manager = engine.manager
    keys = manager.block_keys(tokens[: blocks * manager.geometry.block_tokens], None)
    namespace = namespace_of(manager.fingerprint.digest)
    deadline = time.monotonic() + timeout_s
    while len(manager.peek(namespace, keys)) < blocks:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the haystack's {blocks} blocks were not stored in {timeout_s:.0f} s")
        engine.generate([7, 8, 9], 1)


def _tally(counts: list[int], right: bool) -> None:
    counts[0] += int(right)
    counts[1] += 1


def run_in_child(lengths: Sequence[int], haystacks: int, progress: Callable[[str], None] = print) -> dict:
    """``run_model_needle`` in a child process: one vLLM engine per process, and the codecs' numba
    kernels (compiled at the first decode) must not be loaded when a later engine of this process
    starts (docs/codecs.md: the kernel-override trap). Progress lines stream through."""
    import json
    import subprocess
    import sys

    from kvtier.errors import KvtierError

    cmd = [sys.executable, "-m", "kvtier.bench.vllm.needle", ",".join(map(str, lengths)), str(haystacks)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None and proc.stdout is not None
    tail: list[str] = []
    for line in proc.stderr:
        line = line.rstrip()
        if line.startswith("PROGRESS "):
            progress(line[len("PROGRESS "):])
        elif line:
            tail = (tail + [line])[-20:]
    out = proc.stdout.read()
    if proc.wait() != 0:
        raise KvtierError("the model needle benchmark failed:\n" + "\n".join(tail),
                          hint="run `python -m kvtier.bench.vllm.needle 1024 1` to see it alone")
    return json.loads(out)


if __name__ == "__main__":  # python -m kvtier.bench.vllm.needle LENGTHS HAYSTACKS
    import contextlib
    import json
    import sys

    def _say(msg: str) -> None:
        print(f"PROGRESS {msg}", file=sys.stderr, flush=True)

    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout; stdout is for the result
        result = run_model_needle([int(n) for n in sys.argv[1].split(",")], int(sys.argv[2]), progress=_say)
    print(json.dumps(result))
