"""``python -m benchmarks shared``: the shared tier on real vLLM, against a real redis-server it starts.

* ``cross_box_loaded`` / ``cross_box_outputs_identical``: two ``kvtier serve`` processes stand for
  two boxes (their own DRAM and NVMe, one store). Each session's first turn is served on box A; its
  next turn (the same prompt and more) goes to box B, which must load at least 90% of the full
  blocks A published from the shared tier, and answer exactly what A answers for that turn.
* ``store_down_failed_requests`` / ``store_down_step_p99_vs_baseline``: an in-process engine with the
  shared tier serves a stream of requests (new prompts: every one asks the store) while the server
  is stopped, then paused (SIGSTOP), then restarted in the middle of the load; the p99 of its
  forward steps against the p99 of the same load with the store up, phases interleaved.
* the client ratios and forged values of ``benchmarks.shared``.
"""
from __future__ import annotations

import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["SHARED_KEYS", "run_shared_bench"]

SHARED_KEYS = ("shared_put_vs_client_raw", "shared_get_vs_client_raw", "cross_box_loaded",
               "cross_box_outputs_identical", "store_down_failed_requests", "store_down_step_p99_vs_baseline",
               "foreign_values_served")


def _prompt(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 1990) for _ in range(tokens)]  # the demo models have 2,000 tokens


def cross_box(model: str, base: Path, url: str, sessions: int, prompt_tokens: int,
              progress: Callable[[str], None]) -> dict:
    from kvtier.launch.served import Served

    args = ("--shared", url)
    a = Served(model, base, "box-a", prompt_tokens + 512, nvme_dir=base / "nvme-a", instance="box-a", serve_args=args)
    b = None
    try:
        b = Served(model, base, "box-b", prompt_tokens + 512, nvme_dir=base / "nvme-b", instance="box-b",
                   serve_args=args)
        block_tokens = int(b.admin().get("/v1/status")["block_tokens"])
        prompts = [_prompt(7000 + s, prompt_tokens) for s in range(sessions)]
        for s, prompt in enumerate(prompts):
            a.turn(f"agent-{s}", prompt)
        deadline = time.monotonic() + 30  # published: every session listed by the other box
        while time.monotonic() < deadline:
            listed = {e["session_id"] for e in b.admin().get("/v1/shared/sessions")["sessions"]}
            if all(f"agent-{s}" in listed for s in range(sessions)):
                break
            time.sleep(0.5)
        time.sleep(1.5)  # the publisher's last batch
        loaded_ok = identical = 0
        fractions = []
        for s, prompt in enumerate(prompts):
            turn = prompt + _prompt(9000 + s, 64)
            there = a.turn(f"ref-{s}", turn)
            here = b.turn(f"agent-{s}", turn)
            published = len(prompt) // block_tokens
            fraction = (here["loaded"] // block_tokens) / published if published else 0.0
            fractions.append(fraction)
            loaded_ok += fraction >= 0.9
            identical += here["text"] == there["text"]
            progress(f"session {s}: box B loaded {here['loaded']} tokens of {published * block_tokens} published; "
                     f"{'same' if here['text'] == there['text'] else 'DIFFERENT'} output")
        status = b.admin().get("/v1/status")["shared"]
        return {"cross_box_loaded": loaded_ok / sessions, "cross_box_outputs_identical": identical / sessions,
                "_cross_box_loaded_fraction_min": min(fractions), "_box_b_fetched_blocks": status["fetched_blocks"],
                "_shared_link_gbps": (status.get("link") or {}).get("gbps"), "_block_tokens": block_tokens}
    finally:
        if b is not None:
            b.stop()
        a.stop()


def store_down(model: str, base: Path, server, requests: int, prompt_tokens: int, decode: int,
               progress: Callable[[str], None]) -> dict:
    from kvtier.bench.harness import Engine

    engine = Engine(model, kvtier=True, dram_bytes=512 << 20, max_len=prompt_tokens + decode + 64,
                    extra={"shared": server.url, "shared_timeout_s": 0.5, "measure_links": False})
    core = engine.llm.llm_engine.engine_core.engine_core
    steps: list[float] = []
    step_fn = core.step_fn

    def timed():
        started = time.perf_counter()
        outputs, executed = step_fn()
        if executed:
            steps.append(time.perf_counter() - started)
        return outputs, executed

    core.step_fn = timed
    seed = [0]

    def load(during: Callable[[], None] | None = None) -> tuple[list[float], int]:
        steps.clear()
        failed = 0
        for i in range(requests):
            if during is not None and i == requests // 3:
                threading.Thread(target=during, daemon=True).start()
            seed[0] += 1
            try:
                out = engine.generate(_prompt(seed[0], prompt_tokens), decode)
                failed += len(out.outputs[0].token_ids) != decode
            except Exception as exc:  # noqa: BLE001 - a failed request is what is counted
                progress(f"request failed: {exc}")
                failed += 1
        return list(steps), failed

    try:
        load()  # warm-up: compilation, allocator, the store's connections
        healthy, faulted, failures, warned = [], {}, 0, False
        for fault in ("stopped", "paused", "restarted"):
            up, failed = load()
            healthy += up
            failures += failed
            if fault == "stopped":
                server.stop()
                faulted[fault], failed = load()
                server.start()
            elif fault == "paused":
                server.pause()
                faulted[fault], failed = load()
                server.resume()
            else:
                faulted[fault], failed = load(during=server.restart)
            failures += failed
            warned = warned or "shared" in engine.manager.telemetry.warnings
            progress(f"store {fault}: {failed} failed requests, step p99 "
                     f"{np.percentile(faulted[fault], 99) * 1e3:.1f} ms vs {np.percentile(up, 99) * 1e3:.1f} ms up")
            time.sleep(9)  # the back-off ends; the next healthy phase finds the store again
        # the same number of steps on both sides (three healthy phases, three faulted ones, interleaved):
        # a p99 over fewer samples would sit nearer the maximum
        base_p99 = float(np.percentile(healthy, 99))
        down_p99 = float(np.percentile([t for v in faulted.values() for t in v], 99))
        worst = max(float(np.percentile(v, 99)) for v in faulted.values())
        return {"store_down_failed_requests": failures, "store_down_step_p99_vs_baseline": down_p99 / base_p99,
                "_store_down_baseline_p99_ms": base_p99 * 1e3, "_store_down_p99_ms": down_p99 * 1e3,
                "_store_down_worst_phase_p99_ms": worst * 1e3,
                "_store_down_worst_phase_vs_baseline": worst / base_p99,
                "_store_down_warned": int(warned), "_store_down_steps": len(healthy) + sum(map(len, faulted.values()))}
    finally:
        engine.close()


def run_shared_bench(quick: bool = False, progress: Callable[[str], None] = print, model: str | None = None) -> dict:
    from benchmarks.redisproc import RedisServer
    from benchmarks.shared import run_client_ratios, run_foreign_values
    from kvtier.bench.harness import cpu_environment
    from kvtier.models.demo import ensure_demo_model

    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-shared-") as tmp:
        base = Path(tmp)
        cpu_environment(str(base))
        model = model or str(ensure_demo_model("tiny"))
        with RedisServer(base / "redis") as server:
            progress("the tier against its own client")  # first: nothing else has run in this process yet
            results.update(run_client_ratios(server.url, rounds=3 if quick else 9, progress=progress))
            progress("forged and damaged values")
            results.update(run_foreign_values(server.url, per_kind=45, progress=progress))
            server.client().flushall()
            progress("cross-box: two kvtier serve processes, one store")
            results.update(cross_box(model, base, server.url, 2 if quick else 4, 1024 if quick else 2048, progress))
            progress("store down, paused, restarted under load (in-process engine)")
            results.update(store_down(model, base, server, 6 if quick else 16, 256, 16, progress))
    return results
