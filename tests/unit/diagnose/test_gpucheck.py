"""GPU check (a) in its dry mode: every check but the device's, on the CPU (what a device run runs)."""
from __future__ import annotations

import json

from kvtier.diagnose import gpucheck


def test_dry_run_checks_every_layout_bit_exact_and_reports_json(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert gpucheck.main(["--dry", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dry"] and report["ok"]
    layouts = {k: v for k, v in report["checks"].items() if k.startswith("layout_")}
    assert len(layouts) == 2 * len(gpucheck.LAYOUTS)
    for check in layouts.values():
        assert check["nvme_load_bit_exact"] and check["restore_bit_exact"] and check["dram_bit_exact"]
    assert report["checks"]["overlap"]["step_syncs"] == 0
    assert report["checks"]["pinned"]["arena_bytes"] == report["checks"]["pinned"]["expected_bytes"]
    assert json.loads(capsys.readouterr().out) == report


def test_vllm_layouts_are_strided_views_of_one_allocation():
    import torch

    layers = gpucheck.vllm_layer_views("BLHNC", 3, 5, 2, 16, 8, torch.bfloat16, torch.device("cpu"))
    assert [tuple(x.shape) for x in layers] == [(5, 2, 16, 8)] * 3
    assert not layers[0].is_contiguous()
    assert layers[0].untyped_storage().data_ptr() == layers[2].untyped_storage().data_ptr()


def test_a_broken_load_path_fails_the_check(monkeypatch):
    from kvtier.layout import LayoutAdapter

    original = LayoutAdapter.scatter

    def corrupting(self, src, kv_layers, block_ids):
        original(self, src * 0, kv_layers, block_ids)

    monkeypatch.setattr(LayoutAdapter, "scatter", corrupting)
    report = gpucheck.run_checks(dry=True)
    assert not report["ok"] and not report["checks"]["layout_LBHNC_bfloat16"]["nvme_load_bit_exact"]


def test_an_arena_rounded_up_fails_the_memory_check(monkeypatch):
    """The DRAM tier must cost its size, not the next power of two (as PyTorch's caching host
    allocator would round a pinned request): an arena that takes twice the room fails the check."""
    import torch

    from kvtier.tiers import dram

    fair = gpucheck.pinned_rss(torch.device("cpu"), size_bytes=256 << 20)
    assert fair["rss_ok"] and fair["rss_grown_bytes"] >= fair["rss_arena_bytes"] - (64 << 20)
    original = dram.DramArena.__init__

    def rounded_up(self, num_slots, slot_bytes, *args, **kwargs):
        original(self, 2 * num_slots, slot_bytes, *args, **kwargs)

    monkeypatch.setattr(dram.DramArena, "__init__", rounded_up)
    assert not gpucheck.pinned_rss(torch.device("cpu"), size_bytes=256 << 20)["rss_ok"]
