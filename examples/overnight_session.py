"""The seed's overnight scenario on the tier engine alone (no vLLM, no GPU needed).

An agent session's KV cache is written through to DRAM, demoted to NVMe, snapshotted to a file,
dropped from every tier, and the engine is shut down ("overnight"). A fresh engine, as after a restart, restores the
snapshot and loads the session back into the (stand-in) GPU cache; the script checks that every
byte came back and prints how long each step took.

    python examples/overnight_session.py [--tokens 16384] [--dir DIR]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from kvtier.engine import TierEngine
from kvtier.layout import CpuLayout, KVGeometry, ModelFingerprint
from kvtier.plan.index import Tier, chain_block_hashes, namespace_of


def human(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f} MiB"


def step(label: str, fn):
    start = time.perf_counter()
    value = fn()
    seconds = time.perf_counter() - start
    print(f"  {label:<44} {seconds * 1000:8.1f} ms")
    return value, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="session length in tokens")
    parser.add_argument("--dir", type=Path, default=None, help="where the NVMe tier and snapshot go")
    args = parser.parse_args()

    # A "mid" Llama-like geometry: 16 layers x 4 KV heads x 128 dims, bf16 -> 32 KiB of KV per token.
    geometry = KVGeometry(num_layers=16, num_kv_heads=4, head_dim=128, block_tokens=128, dtype="bfloat16")
    fingerprint = ModelFingerprint("demo-mid-llama", geometry)
    blocks = max(1, args.tokens // geometry.block_tokens)
    layout = CpuLayout(geometry)
    hbm = [torch.randn(layout.layer_shape(blocks)).to(torch.bfloat16) for _ in range(geometry.num_layers)]
    original = [layer.clone() for layer in hbm]
    session_bytes = blocks * geometry.block_bytes
    print(f"kvtier overnight scenario: {blocks * geometry.block_tokens:,} tokens, {blocks} blocks, "
          f"{human(session_bytes)} of KV ({geometry.bytes_per_token // 1024} KiB/token)")

    base = args.dir or Path(tempfile.mkdtemp(prefix="kvtier-demo-"))
    nvme_dir, snapshot = base / "nvme", base / "agent-42.kvsnap"
    namespace = namespace_of(fingerprint.digest)
    keys = chain_block_hashes(list(range(blocks * geometry.block_tokens)), geometry.block_tokens)

    def engine() -> TierEngine:
        return TierEngine(fingerprint, dram_bytes=2 * session_bytes, nvme_dir=nvme_dir,
                          nvme_bytes=4 * session_bytes, kv_layers=hbm)

    print("evening:")
    day = engine()
    step("write-through HBM -> DRAM", lambda: day.store("agent-42", namespace, keys, list(range(blocks))))
    step("evict to NVMe (direct IO, checksummed)", lambda: day.evict("agent-42", Tier.NVME))
    step(f"snapshot -> {snapshot.name}", lambda: day.snapshot("agent-42", snapshot))
    step("drop the session from every tier", lambda: day.evict("agent-42", None))
    day.close()
    for layer in hbm:
        layer.zero_()  # the GPU cache is gone overnight

    print("next morning, fresh process:")
    morning = engine()
    step("restore snapshot -> DRAM (verified)", lambda: morning.restore(snapshot))
    loaded, _ = step("load DRAM -> HBM", lambda: morning.load(namespace, keys, list(range(blocks))))
    same = all(torch.equal(a, b) for a, b in zip(hbm, original))
    info = morning.manager.views.session_info("agent-42")
    morning.close()
    print(f"restored {loaded}/{blocks} blocks, bit-identical: {same}; session state: {info['state']}, "
          f"{human(info['bytes_dram'])} in DRAM")
    print(f"files kept in {base}")
    if not same or loaded != blocks:
        raise SystemExit("error: the restored session differs from the original")


if __name__ == "__main__":
    main()
