"""``kvtier.plugins.vllm.compat``: the vLLM version policy, the table of internals (complete, and
each one real in the installed vLLM), and ``vllm_info`` without importing vLLM or torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from support.realpath import need

from kvtier.errors import ConfigError
from kvtier.plugins.vllm import compat

PLUGIN = Path(compat.__file__).parent


@pytest.mark.parametrize("version", ["0.31.2", "0.20.0", "0.31.9+cu128"])
def test_a_vllm_older_than_0_32_is_refused_with_the_pip_hint(version):
    with pytest.raises(ConfigError) as caught:
        compat.check_vllm_version(version)
    assert version in caught.value.message and "\n" not in caught.value.message
    assert caught.value.hint == 'pip install "vllm>=0.32,<0.34"'


def test_an_old_vllm_is_refused_before_kvtier_touches_its_internals(monkeypatch):
    """An older vLLM lacks some of the classes the connector imports: the first internal asked for
    raises the one-line error, not an ImportError traceback."""
    monkeypatch.setattr(compat, "_VERSION_OK", False)
    monkeypatch.setattr(compat, "running_vllm_version", lambda: "0.31.0")  # what an old install reports
    with pytest.raises(ConfigError, match="vLLM 0.31.0 is older"):
        compat.KVConnectorWorkerMetadata  # noqa: B018
    assert compat._VERSION_OK is False  # asked again, refused again


@pytest.mark.parametrize("version, status, warned", [
    ("0.32.0", "tested", False), ("0.32.0+cpu", "tested", False),
    ("0.33.0", "api-checked", False), ("0.33.0+cu130", "api-checked", False),
    ("0.32.1", "untested", True), ("0.33.2", "untested", True),
    ("0.34.0", "newer", True), ("1.0.0", "newer", True), ("main", "unknown", True),
])
def test_versions_in_and_past_the_range(version, status, warned, caplog):
    assert compat.version_status(version)[0] == status
    note = compat.check_vllm_version(version)
    assert (note is not None) == warned
    if status == "newer":
        assert "newer than kvtier's supported range (>=0.32.0,<0.34)" in note
    info = compat.vllm_info(version)
    assert info["version"] == version and info["tested"] == (status == "tested") and info["status"] == status


def test_vllm_info_reads_the_installed_distribution_without_importing_vllm_or_torch():
    code = ("import json, sys\nfrom kvtier.plugins.vllm.compat import vllm_info\ninfo = vllm_info()\n"
            "print(json.dumps([info, sorted(m for m in ('torch', 'vllm') if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import json

    info, imported = json.loads(out.stdout)
    assert imported == []
    distribution, version = compat.installed_vllm()
    assert info["version"] == version and info["distribution"] == distribution
    if version is None:
        assert info["status"] == "not-installed" and not info["tested"]


def vllm_imports(path: Path) -> set[tuple[str, str]]:
    """(module, name) of every ``from vllm... import name`` in a file, lazy ones included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            found |= {(node.module, alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "vllm" for a in node.names), f"{path.name}: import vllm..."
    return found


def test_every_vllm_internal_the_connector_imports_is_in_the_table():
    """A vLLM import anywhere in the connector is one the API check knows of; the connector's own
    modules get them from compat."""
    listed = {(i.module, i.name.partition(".")[0]) for i in compat.INTERNALS}
    unlisted = {f"{path.name}: {module}.{name}" for path in PLUGIN.glob("*.py") if path.name != "compat.py"
                for module, name in vllm_imports(path) if (module, name) not in listed}
    assert unlisted == set()
    for name in ("connector.py", "geometry.py", "__init__.py", "worker.py", "sleep.py"):
        assert vllm_imports(PLUGIN / name) == set(), name  # through compat only


def test_the_table_finds_an_unlisted_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from vllm.v1.request import Request\n")
    assert vllm_imports(probe) == {("vllm.v1.request", "Request")}


def test_every_top_level_internal_resolves_in_the_installed_vllm():
    import inspect

    need("vllm")
    for internal in compat.INTERNALS:
        owner, _, member = internal.name.partition(".")
        if owner == "NONE_HASH":  # set by vLLM once an engine starts
            continue
        value = getattr(compat, owner)
        # a member: a class attribute, or one its methods set on instances
        assert not member or hasattr(value, member) or f"self.{member} =" in inspect.getsource(value), internal
    with pytest.raises(AttributeError):
        compat.NoSuchInternal  # noqa: B018
