"""``kvtier bench codecs`` times only decodes and restores that gave the right blocks back: a decode
that returns other bytes than the codec's own decode of what was written, or a restore whose blocks
differ from it, refuses the figures instead of recording a speed."""
from __future__ import annotations

import pytest

from kvtier.bench import codecs as bench
from kvtier.bench.checks import FigureRefused
from kvtier.codecs import register_reference
from kvtier.codecs.base import Identity


class DriftingDecode(Identity):
    """A codec whose decode gives the right bytes the first ``good`` times, then one byte off (a
    decoder that goes wrong under load, say)."""

    def __init__(self, good: int):
        self.calls, self.good = 0, good

    def decode(self, payload, out) -> None:
        super().decode(payload, out)
        self.calls += 1
        if self.calls > self.good:
            out.view(-1)[7] += 1


def test_a_healthy_run_records_every_figure(tmp_path):
    results = bench.run_codecs_bench(quick=True, directory=str(tmp_path), progress=lambda _m: None,
                                     codecs=("none", "fp8"))
    for key in bench.codec_keys(("none", "fp8")):
        assert results[key] > 0, key


def test_a_decode_that_gives_other_bytes_refuses_the_figures(tmp_path):
    register_reference("drift-test-a", DriftingDecode(good=8))  # right while the bench learns its bytes
    with pytest.raises(FigureRefused, match="drift-test-a: a timed decode gave other bytes"):
        bench.run_codecs_bench(quick=True, directory=str(tmp_path), progress=lambda _m: None,
                               codecs=("drift-test-a",))


def test_a_restore_that_gives_other_blocks_refuses_the_figures(tmp_path):
    import torch

    blocks = bench.synthetic_blocks(bench._geometry(), 4)
    figures, payloads, sizes, expected = bench._throughput("none", blocks, reps=1)
    raw = bench.RawDirectIO(tmp_path, 4 * (2 << 20), chunk=8 << 20)
    raw.write()
    try:
        assert bench._restore("none", payloads, sizes, expected, tmp_path, raw, reps=1)["none_restore_vs_raw_read"] > 0
        other = expected.clone()
        other[2].view(-1)[0] += torch.tensor(1, dtype=other.dtype)  # what the restore should have given: not this
        with pytest.raises(FigureRefused, match="none: a restore from the NVMe tier gave other blocks"):
            bench._restore("none", payloads, sizes, other, tmp_path, raw, reps=1)
    finally:
        raw.close()
