"""Durable file IO has one door (``kvtier.tiers.fileio``): what the power-cut recorder wraps must be
everything the tiers and the persistence layer write, or a crash state built from its trace would
miss an operation."""
from __future__ import annotations

import ast
from pathlib import Path

import kvtier

CORE = Path(kvtier.__file__).parent
WRITERS = sorted([*(CORE / "tiers").rglob("*.py"), *(CORE / "persist").rglob("*.py")])
DOOR = CORE / "tiers" / "fileio.py"
REFERENCE = CORE / "tiers" / "nvme" / "rawio.py"  # the benchmarks' raw-disk yardstick, not kvtier's state

OS_WRITES = {"write", "pwrite", "pwritev", "fsync", "fdatasync", "rename", "replace", "unlink", "remove",
             "ftruncate", "truncate", "mkdir", "makedirs", "rmdir", "posix_fallocate"}
PATH_WRITES = {"write_bytes", "write_text", "mkdir", "unlink", "rename", "rmdir", "touch"}


def side_doors(paths) -> list[str]:
    """Calls that change files without going through the door: ``os.<write>`` and ``Path``'s
    writing methods (any ``x.unlink()``-shaped call: a false alarm is cheaper than a missed write)."""
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value
            name = node.func.attr
            via_os = isinstance(owner, ast.Name) and owner.id == "os" and name in OS_WRITES
            via_path = name in PATH_WRITES and not (isinstance(owner, ast.Name) and owner.id in ("fileio", "self"))
            if via_os or via_path:
                out.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}")
    return out


def test_the_tiers_and_persistence_write_only_through_fileio():
    assert side_doors([p for p in WRITERS if p not in (DOOR, REFERENCE)]) == []


def test_the_check_sees_a_side_door(tmp_path):
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("import os\nfrom pathlib import Path\n"
                      "def f(fd, p):\n    os.fdatasync(fd)\n    Path(p).unlink()\n    fileio.unlink(p)\n")
    assert [line.split(" ")[1] for line in side_doors([sneaky])] == ["os.fdatasync", "Path(p).unlink"]
