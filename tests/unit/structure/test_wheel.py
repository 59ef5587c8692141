"""The wheel ships the product, not the project's test rig: built for real (``pip wheel``) from a copy
of the source tree, it holds kvtier's packages and no fault, power, trust, quality, scale or needle
module; ``benchmarks/`` is not in it."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
RIG = re.compile(r"(fault|power|trust|quality|scale|needle|constructed|retrieval|redisproc)", re.I)
PRODUCT = {"kvtier/persist/trust.py"}  # who may sign snapshots: the product's own, not the rig's trust suite
OPERATOR_BENCHES = {"__init__", "checks", "harness", "tiers", "restore", "codecs", "serve", "costmodel", "arms",
                    "load", "regimes", "report", "run", "trace"}  # kvtier bench: what an operator measures


def test_the_wheel_holds_no_module_of_the_test_rig(tmp_path):
    source = tmp_path / "src"
    for part in ("kvtier", "tui", "plugins", "benchmarks"):
        shutil.copytree(REPO / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("kvtier-*.whl")
    names = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")]
    assert "kvtier/cli/main.py" in names and "kvtier/bench/restore.py" in names  # the product is there
    assert "kvtier/plugins/vllm/connector.py" in names and "kvtier/tui/app.py" in names
    assert [n for n in names if n.startswith("benchmarks/")] == []
    assert [n for n in names if RIG.search(Path(n).stem) and n not in PRODUCT] == []
    assert {Path(n).stem for n in names if n.startswith("kvtier/bench/")} == OPERATOR_BENCHES
