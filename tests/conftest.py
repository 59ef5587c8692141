"""Shared fixtures: a small KV geometry, CPU-layout 'HBM' tensors and the demo models.

Helpers a test imports live in ``tests/support`` (engines on real disks, a fake clock, a fake
mover, the served-engine and terminal harnesses)."""
from __future__ import annotations

import os

import pytest

pytest_plugins = ("support.realpath",)  # what a CI run requires: vLLM imported, no unexpected skip

os.environ.setdefault("OMP_NUM_THREADS", "2")
# numba's llvmlite, once imported, trips vLLM 0.32's kernel-override scan at engine creation
# ("'_lib_fn_wrapper' object has no attribute 'get'"). Engines are created in this process, so the
# codecs use their torch path here; the numba kernels are tested in a subprocess (test_codecs.py).
os.environ.setdefault("KVTIER_NO_NUMBA", "1")
# snapshot signing keys (kvtier.persist.trust) of the test run, not of the user running it
os.environ.setdefault("KVTIER_SNAPSHOT_KEYS", os.path.join(__import__("tempfile").gettempdir(),
                                                           f"kvtier-test-keys-{os.getuid()}", "snapshot-keys"))


@pytest.fixture
def geometry():
    from kvtier.layout import KVGeometry

    return KVGeometry(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16, dtype="bfloat16")


@pytest.fixture
def fingerprint(geometry):
    from kvtier.layout import ModelFingerprint

    return ModelFingerprint("test-model", geometry)


@pytest.fixture
def hbm(geometry):
    """vLLM-style per-layer KV tensors (CPU backend layout) with 64 blocks of random data."""
    import torch

    from kvtier.layout import CpuLayout

    torch.manual_seed(0)
    shape = CpuLayout(geometry).layer_shape(64)
    return [torch.randn(shape).to(torch.bfloat16) for _ in range(geometry.num_layers)]


# --- demo model (kvtier.models.demo) ------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model():
    """Path of the random-weight tiny demo model, built once into a stable dir shared by test runs.

    Set KVTIER_TEST_MODEL_CACHE to move it (default ~/.cache/kvtier-test/models).
    """
    from kvtier.models.demo import ensure_demo_model

    cache = os.environ.get("KVTIER_TEST_MODEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvtier-test", "models")
    return ensure_demo_model("tiny", cache_dir=cache)


@pytest.fixture(scope="session")
def mid_model():
    """The mid demo model (~350 MB, built once like the tiny one; only the two-instance test serves it)."""
    from kvtier.models.demo import ensure_demo_model

    cache = os.environ.get("KVTIER_TEST_MODEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvtier-test", "models")
    return ensure_demo_model("mid", cache_dir=cache)
