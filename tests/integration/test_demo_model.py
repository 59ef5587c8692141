"""The random-weight demo model: build once, atomic + locked builds, and it runs in vLLM."""
from __future__ import annotations

import fcntl
import gc
import hashlib
import json
import shutil
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from kvtier.errors import KvtierError, UsageError
from kvtier.models.demo import (
    DEMO_SIZES,
    TORCHVISION_HINT,
    demo_model_dir,
    ensure_demo_model,
    is_demo_model,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """One tiny build shared by this module's tests (cache_dir is a fresh tmp dir)."""
    return ensure_demo_model("tiny", cache_dir=tmp_path_factory.mktemp("models"))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_layout_and_geometry(built):
    assert built.name == "kvtier-demo-tiny-v1"
    assert (built / ".complete").is_file()
    assert not list(built.parent.glob(".kvtier-demo-tiny-v1.tmp-*"))
    cfg = json.loads((built / "config.json").read_text())
    geo = DEMO_SIZES["tiny"]
    assert cfg["hidden_size"] == geo["hidden"] == 256
    assert cfg["num_hidden_layers"] == geo["layers"]
    assert cfg["num_attention_heads"] == geo["heads"]
    assert cfg["num_key_value_heads"] == geo["kv_heads"]
    assert cfg["intermediate_size"] == geo["intermediate"]
    assert cfg["max_position_embeddings"] == 32768
    assert 1000 < cfg["vocab_size"] <= 2003
    assert (built / "model.safetensors").stat().st_size > 1_000_000


def test_tokenizer_round_trips(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    text = "def f(x):\n    return {'k': x + 1}  # naïve ünïcode ✓\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id == 0
    assert max(ids) < len(tok)
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<s>user: hi\nassistant:"


def test_demo_marker(built, tmp_path):
    info = json.loads((built / "kvtier-demo.json").read_text())
    assert info["kvtier_demo"] is True and info["size"] == "tiny"
    assert 3_000_000 < info["params"] < 4_000_000
    assert is_demo_model(built) and is_demo_model(str(built))
    assert not is_demo_model(tmp_path)
    (tmp_path / "kvtier-demo.json").write_text("{not json")
    assert not is_demo_model(tmp_path)


def test_second_call_does_not_rebuild(built):
    weights = built / "model.safetensors"
    before = weights.stat().st_mtime_ns
    messages: list[str] = []
    assert ensure_demo_model("tiny", cache_dir=built.parent, progress=messages.append) == built
    assert weights.stat().st_mtime_ns == before
    assert messages == []


def test_incomplete_leftovers_are_rebuilt_deterministically(built, tmp_path):
    final = demo_model_dir("tiny", tmp_path)
    final.mkdir(parents=True)
    (final / "config.json").write_text("{half written")  # a build that never got its marker
    stale = tmp_path / ".kvtier-demo-tiny-v1.tmp-crashed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"junk")
    messages: list[str] = []
    assert ensure_demo_model("tiny", cache_dir=tmp_path, progress=messages.append) == final
    assert (final / ".complete").is_file() and not stale.exists()
    assert any("removing incomplete build" in m for m in messages)
    json.loads((final / "config.json").read_text())
    # torch.manual_seed(0) + sorted stdlib file list: byte-identical to the other build
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(final / name) == _sha(built / name), name


def test_waits_for_a_concurrent_builder_and_reuses_its_result(built, tmp_path):
    final = demo_model_dir("tiny", tmp_path)
    messages: list[str] = []
    said = threading.Event()  # set by the builder's first progress message (it says it waits)
    result: list[object] = []

    def progress(message: str) -> None:
        messages.append(message)
        said.set()

    with open(tmp_path / ".kvtier-demo-tiny-v1.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # play the other builder
        worker = threading.Thread(target=lambda: result.append(
            ensure_demo_model("tiny", cache_dir=tmp_path, progress=progress)))
        worker.start()
        assert said.wait(30)
        assert messages and "waiting" in messages[0]
        assert worker.is_alive()
        shutil.copytree(built, final)  # the "other builder" finishes (rename with marker inside)
    worker.join(60)
    assert result == [final]
    assert not any("training" in m for m in messages)


def test_unknown_size_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError) as info:
        ensure_demo_model("huge", cache_dir=tmp_path)
    assert "huge" in info.value.message
    assert "tiny" in info.value.hint and "mid" in info.value.hint
    assert list(tmp_path.iterdir()) == []


def test_broken_torchvision_is_explained_and_leaves_nothing(tmp_path, monkeypatch):
    def broken(name):
        try:
            raise RuntimeError("operator torchvision::nms does not exist")
        except RuntimeError as exc:
            raise ModuleNotFoundError(f"Could not import module {name!r}.") from exc

    fake = types.ModuleType("transformers")
    fake.__getattr__ = broken  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", fake)
    with pytest.raises(KvtierError) as info:
        ensure_demo_model("tiny", cache_dir=tmp_path)
    assert info.value.hint == TORCHVISION_HINT
    assert "torchvision" in info.value.message
    assert [p.name for p in tmp_path.iterdir()] == [".kvtier-demo-tiny-v1.lock"]


def test_import_does_not_load_torch():
    code = "import kvtier.models.demo, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_shared_tiny_model_fixture(tiny_model):
    assert (tiny_model / ".complete").is_file() and is_demo_model(tiny_model)


@pytest.mark.slow
def test_tiny_model_generates_in_vllm(built, tmp_path, monkeypatch):
    import tempfile

    for name, value in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
                        "TMPDIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(built), dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=2048,
              enforce_eager=True, seed=0)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = llm.generate(["def f(x):", "import os"], params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
        again = llm.generate(["def f(x):"], params, use_tqdm=False)
        assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids  # greedy is deterministic
    finally:
        del llm
        gc.collect()
