"""Layering: kvtier core never imports vLLM or Textual; `kvtier --help` never imports torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvtier

CORE = Path(kvtier.__file__).parent
FORBIDDEN_IN_CORE = {"vllm", "textual"}


def imported_top_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_core_modules_never_import_vllm_or_textual():
    core_files = [p for p in CORE.rglob("*.py") if not {"tui", "plugins"} & set(p.relative_to(CORE).parts)]
    assert len(core_files) > 10
    offenders = {str(p.relative_to(CORE)): imported_top_modules(p) & FORBIDDEN_IN_CORE for p in core_files}
    assert {k: v for k, v in offenders.items() if v} == {}


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sys.modules))"],
                         capture_output=True, text=True, check=True)
    return {line.split(".")[0] for line in out.stdout.splitlines()}


def test_kvtier_help_imports_no_torch():
    code = (
        "import sys\n"
        "from kvtier.cli.main import app\n"
        "try:\n"
        "    app(['--help'], prog_name='kvtier')\n"
        "except SystemExit:\n"
        "    pass\n"
    )
    loaded = _modules_after(code)
    assert "typer" in loaded  # the CLI really ran
    assert not loaded & {"torch", "vllm", "textual", "numpy"}


def test_scheduler_side_modules_import_no_torch():
    loaded = _modules_after("import kvtier.manager, kvtier.index, kvtier.policy, kvtier.config, kvtier.errors, "
                            "kvtier.snapshot, kvtier.tiers.nvme")
    assert "kvtier" in loaded
    assert not loaded & {"torch", "vllm", "textual"}


def test_kvtier_status_imports_no_torch(tmp_path):
    # no server: the command fails with exit 3, having loaded only the client side
    code = (
        "import sys\n"
        "from kvtier.cli.main import app\n"
        "try:\n"
        f"    app(['status', '--socket', '{tmp_path}/none.sock'], prog_name='kvtier')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 3, exc.code\n"
    )
    loaded = _modules_after(code)
    assert "kvtier" in loaded and not loaded & {"torch", "vllm", "textual", "numpy"}


def test_admin_server_modules_import_no_torch():
    loaded = _modules_after("import kvtier.control.server, kvtier.control.api, kvtier.control.client")
    assert not loaded & {"torch", "vllm", "textual"}


def test_every_package_directory_is_installed():
    """A non-editable install ships only the packages pyproject lists; a missed subpackage breaks
    `pip install .` while editable installs (and so the tests) still work."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib

    root = Path(kvtier.__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = {folder: name for name, folder in config["package-dir"].items()}
    found = set()
    for folder, name in roots.items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder).parts
            found.add(".".join((name, *rel)))
    assert found <= listed, f"not installed: {sorted(found - listed)}"


def test_tui_only_talks_to_the_admin_client():
    """tui -> kvtier.control (client, GPU telemetry, the instance registry) and the pure turn formatter
    only: never vLLM, torch, or the tier manager itself."""
    tui = Path(kvtier.__file__).resolve().parents[1] / "tui"
    allowed_kvtier = {"kvtier.control.client", "kvtier.control.gpu", "kvtier.control.instances", "kvtier.errors",
                      "kvtier.reasons", "kvtier.tui.model", "kvtier.tui.collector", "kvtier.tui.app"}
    for path in tui.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for name in names:
                assert name.split(".")[0] not in {"torch", "vllm", "numpy"}, (path.name, name)
                if name.startswith("kvtier"):
                    assert name in allowed_kvtier, (path.name, name)
    loaded = _modules_after("import kvtier.tui.app, kvtier.tui.collector")
    assert "textual" in loaded and not loaded & {"torch", "vllm"}
