"""An in-process vLLM engine with kvtier, for the demo and the serving benchmark.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the connector's scheduler
half is reachable: operator actions (evict, snapshot, restore) are planned on its manager and
shipped to the worker with the next engine step, exactly as the admin API will do in a server.
Only one engine may be alive per process (vLLM keeps one KV connector per process).
"""
from __future__ import annotations

import gc
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Engine", "cpu_environment"]


def cpu_environment(tmp: str | None = None) -> None:
    """Environment for an in-process vLLM on a CPU-only box (set before vLLM is imported)."""
    tmp = tmp or tempfile.mkdtemp(prefix="kvtier-vllm-")
    defaults = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": os.path.join(tmp, "cache"),
                "VLLM_LOGGING_LEVEL": "WARNING"}
    from kvtier.launch.serve import is_cpu_only

    if is_cpu_only():
        defaults.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="4")
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


class Engine:
    """One vLLM engine; with ``kvtier=True`` it runs the KVTierConnector (asynchronous transfers, as
    served; ``extra={"synchronous": True}`` runs them on the step path instead)."""

    def __init__(self, model: str, kvtier: bool, nvme_dir: str | Path | None = None, dram_bytes: int = 2 << 30,
                 max_len: int = 16384 + 256, max_batched: int = 2048, model_id: str | None = None,
                 max_logprobs: int = 20, extra: dict | None = None):
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kwargs: dict[str, Any] = {}
        if kvtier:
            config = {"dram_bytes": dram_bytes, "model_id": model_id or Path(model).name}
            if nvme_dir is not None:
                config.update(nvme_dir=str(nvme_dir), nvme_bytes=64 << 30)
            config.update(extra or {})
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector="KVTierConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config=config)
        self.llm = LLM(model=model, dtype="bfloat16", max_model_len=max_len, max_num_batched_tokens=max_batched,
                       enforce_eager=True, enable_prefix_caching=True, seed=0, max_logprobs=max_logprobs, **kwargs)

    @property
    def connector(self):
        return self.llm.llm_engine.engine_core.engine_core.scheduler.connector

    @property
    def worker(self):
        """The connector's worker half (in this process: vLLM runs in-process)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()._worker

    @property
    def manager(self):
        return self.connector.manager

    def generate(self, prompt_ids: Sequence[int], max_tokens: int = 1, logprobs: int | None = None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
        return self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt_ids))], params, use_tqdm=False)[0]

    def timed(self, prompt_ids: Sequence[int], max_tokens: int = 1) -> tuple[float, Any]:
        start = time.perf_counter()
        out = self.generate(prompt_ids, max_tokens)
        return time.perf_counter() - start, out

    def run_job(self, job, timeout_s: float = 600.0) -> None:
        """Ship an operator job to the worker and step the engine (one-token requests) until its
        result is back (a background job finishes a step or more after it ships)."""
        if job is None:
            return
        self.connector._scheduler.enqueue(job)
        deadline = time.monotonic() + timeout_s
        while True:
            self.generate([7, 8, 9], 1)
            with self.connector._scheduler.lock:
                if job.job_id not in self.manager.jobbook.jobs:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvtier job {job.job_id} ({job.kind.value}) did not finish in {timeout_s:.0f} s")
            time.sleep(0.01)

    def forget_hbm(self, timeout_s: float = 60.0) -> None:
        """Empty vLLM's prefix cache, for real. A request whose blocks kvtier is still storing stays
        allocated until the worker reports the store done, and the worker reports only in a step:
        vLLM refuses the reset until then (``reset_prefix_cache`` answers False), and the next
        prompt would be a prefix-cache hit, not a load. Step the idle engine until it succeeds."""
        deadline = time.monotonic() + timeout_s
        while not self.llm.reset_prefix_cache():
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM's prefix cache still in use after {timeout_s:.0f} s")
            self.llm.llm_engine.step()  # an empty step: the worker reports its finished stores
            time.sleep(0.005)

    def close(self) -> None:
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        self.llm.llm_engine.engine_core.shutdown()
        ensure_kv_transfer_shutdown()
        del self.llm
        gc.collect()
