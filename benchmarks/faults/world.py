"""The fault benchmark's small world: an engine whose blocks are functions of their keys, so that
every load is checked against the truth."""
from __future__ import annotations

from pathlib import Path

SHAPE = (2, 2, 32, 16)  # layers, KV heads, head dim, block tokens: 8 KiB blocks in bf16
HBM_BLOCKS = 48


# ---- a small world: an engine whose blocks are functions of their keys ---------------------------------
def _fingerprint(name: str = "faults-model"):
    from kvtier.layout import KVGeometry, ModelFingerprint

    return ModelFingerprint(name, KVGeometry(*SHAPE))


def reference_block(key: bytes, geometry):
    """The canonical block kvtier must hand back for ``key``: random bits seeded by the key."""
    import torch

    generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & ((1 << 63) - 1))
    bits = torch.randint(-32768, 32767, (1, *geometry.block_shape), dtype=torch.int16, generator=generator)
    return bits.view(torch.bfloat16)


class World:
    """A ``TierEngine`` on CPU-layout 'HBM', with helpers to put reference blocks in and check them."""

    def __init__(self, root: Path, dram_blocks: int = 24, nvme_blocks: int = 400, name: str = "faults-model",
                 cold_codec: str = "none"):
        import torch

        from kvtier.engine import TierEngine
        from kvtier.layout import CpuLayout, adapter_for
        from kvtier.plan.index import namespace_of
        from kvtier.tiers.nvme.store import file_bytes_for

        self.fingerprint = _fingerprint(name)
        self.geometry = g = self.fingerprint.geometry
        self.hbm = [torch.zeros(CpuLayout(g).layer_shape(HBM_BLOCKS),
                                dtype=torch.bfloat16) for _ in range(g.num_layers)]
        self.adapter = adapter_for("cpu", g)
        self.root = Path(root)
        self.snapshots = self.root / "snapshots"
        self.snapshots.mkdir(parents=True, exist_ok=True)
        self.engine = TierEngine(self.fingerprint, dram_blocks * g.block_bytes, self.root / "nvme",
                                 nvme_blocks * file_bytes_for(g.block_bytes), kv_layers=self.hbm, io_threads=2,
                                 cold_codec=cold_codec)
        self.ns = namespace_of(self.fingerprint.digest)

    def put(self, keys, device_blocks) -> None:
        """Fill HBM blocks with the reference content of ``keys`` (what vLLM's forward would compute)."""
        import torch

        if keys:
            blocks = torch.cat([reference_block(k, self.geometry) for k in keys])
            self.adapter.scatter(blocks, self.hbm, list(device_blocks))

    def wrong(self, keys, device_blocks) -> list[bytes]:
        """Keys whose HBM block differs (bit for bit) from its reference."""
        import torch

        out = torch.empty((len(keys), *self.geometry.block_shape), dtype=torch.bfloat16)
        self.adapter.gather(self.hbm, list(device_blocks), out)
        return [k for i, k in enumerate(keys)
                if not torch.equal(out[i].view(torch.int16), reference_block(k, self.geometry)[0].view(torch.int16))]

    def scrub(self, device_blocks) -> None:
        """Poison HBM blocks so a load that writes nothing cannot pass for a correct one."""
        import torch

        poison = torch.full((len(device_blocks), *self.geometry.block_shape), float("nan"), dtype=torch.bfloat16)
        self.adapter.scatter(poison, self.hbm, list(device_blocks))

    def load_and_check(self, keys: list[bytes]) -> tuple[int, list[bytes]]:
        """Load the stored prefix of ``keys`` (in HBM-sized batches): (blocks loaded, wrong ones)."""
        loaded, wrong = 0, []
        for start in range(0, len(keys), HBM_BLOCKS):
            batch = keys[start : start + HBM_BLOCKS]
            device = list(range(len(batch)))
            self.scrub(device)
            n = self.engine.load(self.ns, batch, device)
            loaded += n
            wrong += self.wrong(batch[:n], device[:n])
            if n < len(batch):
                break
        return loaded, wrong

    def visible_nvme_keys(self) -> set[bytes]:
        from kvtier.plan.index import IN_NVME, PENDING

        index = self.engine.manager.table.index
        flags = index.col["flags"]
        return {index.key_of(r)[1] for r in range(len(index._keys))
                if index._keys[r] is not None and flags[r] & IN_NVME and not flags[r] & PENDING}

    def close(self) -> None:
        self.engine.close(write_back=False)


def _tokens(tag: int, blocks: int, prefix: list[int] | None = None) -> list[int]:
    base = list(prefix or [])
    return base + [(tag * 7919 + i * 131) % 50_000 for i in range(blocks * SHAPE[3] - len(base))]
