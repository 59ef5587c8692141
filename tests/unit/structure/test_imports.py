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
    """(kvtier.bench runs real vLLM: a layer above the core, as the CLI is.)"""
    core_files = [p for p in CORE.rglob("*.py") if not {"tui", "plugins", "bench",
                                                        "cli"} & set(p.relative_to(CORE).parts)]
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
    loaded = _modules_after("import kvtier.plan.manager, kvtier.plan.index, kvtier.plan.policy, kvtier.config, "
                            "kvtier.errors, kvtier.persist.snapshot, kvtier.tiers.nvme.store")
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
    """tui -> kvtier.control (client, GPU telemetry, the instance registry), the pure turn formatter and units
    only: never vLLM, torch, or the tier manager itself."""
    tui = Path(kvtier.__file__).resolve().parents[1] / "tui"
    allowed_kvtier = {"kvtier.control.client", "kvtier.control.gpu", "kvtier.control.instances", "kvtier.errors",
                      "kvtier.plan.reasons", "kvtier.units", "kvtier.tui.model", "kvtier.tui.collector",
                      "kvtier.tui.app", "kvtier.tui.widgets"}
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


# ---- the import graph: no cycles, layers point one way ------------------------------------------------
SOURCE_ROOTS = {"kvtier": CORE, "kvtier.tui": CORE.parent / "tui", "kvtier.plugins": CORE.parent / "plugins",
                "benchmarks": CORE.parent / "benchmarks"}  # the project's own test rig, beside the product


def _modules() -> dict[str, Path]:
    """Every module of the installed package by its dotted name (tui/ and plugins/ live beside kvtier/),
    and of the test rig (``benchmarks``)."""
    out = {}
    for package, root in SOURCE_ROOTS.items():
        for path in root.rglob("*.py"):
            if package == "kvtier" and {"tui", "plugins"} & set(path.relative_to(root).parts):
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package ``name`` imports: at module level, lazily (inside functions) and for type
    hints only (``if TYPE_CHECKING:``) alike. A type-only import never runs, but it is a dependency all
    the same: a part that names its host's class for its hints is tied to the host."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(anchor[: len(anchor) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    resolved = set()
    for module in found:  # "kvtier.x.y" counts as the deepest known module it names
        while module and module not in known:
            module = module.rpartition(".")[0]
        if module and module != name:
            resolved.add(module)
    return resolved


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_lazy_and_type_only_imports_included():
    graph = import_graph()
    assert any(name.startswith("benchmarks.") for name in graph)  # the rig is in the graph too
    assert cycles(graph) == []


OUTER = ("kvtier.bench", "kvtier.plugins", "kvtier.tui", "kvtier.cli")
ENGINE = ("kvtier.plan", "kvtier.move", "kvtier.tiers", "kvtier.persist", "kvtier.codecs", "kvtier.engine",
          "kvtier.jobs", "kvtier.layout")
APPS = ("kvtier.launch", "kvtier.diagnose", "kvtier.models", "kvtier.control")
PRODUCT = ("kvtier", "kvtier.tui", "kvtier.plugins")  # all of it, the outer layers included
DIRECTIONS = [  # (modules under these names, never import these, why)
    (PRODUCT, ("benchmarks",), "the product never needs its test rig: the rig is not installed"),
    (("kvtier",), OUTER, "the core is a library: the CLI, benchmarks, connector and dashboard sit above it"),
    (("kvtier.plugins",), ("kvtier.bench", "kvtier.tui", "kvtier.cli"), "the connector runs inside vLLM alone"),
    (("kvtier.control.api",), ("kvtier.control.server",), "routes know nothing of the HTTP loop"),
    (ENGINE, APPS, "the engine's halves never reach up into launching, diagnostics, demo models or the admin plane"),
    (("kvtier.plan",), ("kvtier.move", "kvtier.engine"), "the scheduler half plans; it never runs a move"),
    (("kvtier.move",), ("kvtier.plan", "kvtier.engine", "kvtier.tiers.nvme", "kvtier.tiers.shared"),
     "the worker half runs jobs and reaches tiers only through kvtier.tiers.base"),
    (("kvtier.tiers",), ("kvtier.plan", "kvtier.move", "kvtier.engine", "kvtier.codecs"),
     "a tier stores blocks; it never plans, moves or decodes them"),
    (("kvtier.persist",), ("kvtier.move", "kvtier.engine"), "persistence writes files; it runs no jobs"),
]


def _under(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def direction_breaks(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    wrong = {}
    for module, deps in graph.items():
        for sources, banned, why in DIRECTIONS:
            core_rule = sources == ("kvtier",)  # "the core": every module but the outer layers
            if _under(module, sources) and not (core_rule and _under(module, OUTER)):
                bad = sorted(d for d in deps if _under(d, banned))
                if bad:
                    wrong.setdefault(module, []).extend(f"{d} ({why})" for d in bad)
    return wrong


def test_the_direction_check_finds_a_break():
    assert direction_breaks({"kvtier.plan.x": {"kvtier.move.mover"}, "kvtier.move.mover": {"kvtier.tiers.base"}}) \
        == {"kvtier.plan.x": ["kvtier.move.mover (the scheduler half plans; it never runs a move)"]}
    assert list(direction_breaks({"kvtier.plugins.vllm.x": {"kvtier.cli.main"}, "kvtier.cli.main": {"kvtier.tui"}})) \
        == ["kvtier.plugins.vllm.x"]
    assert direction_breaks({"kvtier.bench.serve": {"benchmarks.faults.world"}, "kvtier.tui.app": {"benchmarks"},
                             "benchmarks.scale": {"kvtier.plan.manager"}}) == {
        "kvtier.bench.serve": ["benchmarks.faults.world (the product never needs its test rig: the rig is not "
                               "installed)"],
        "kvtier.tui.app": ["benchmarks (the product never needs its test rig: the rig is not installed)"]}


def test_layers_point_one_way():
    assert direction_breaks(import_graph()) == {}


# ---- the manager's parts: the connector and the admin plane call them, never poke their state -----------
PART_INSIDES = {("table", "index"), ("table", "policies"), ("jobbook", "queued")}  # bookkeeping (and any _name)


def _is_manager(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "manager") or \
        (isinstance(node, ast.Name) and node.id == "manager")


def _after_manager(node: ast.AST) -> list[str] | None:
    """``["table", "index"]`` for ``<...>.manager.table.index``; None when ``node`` does not reach
    through a manager."""
    names = []
    while isinstance(node, ast.Attribute) and not _is_manager(node):
        names.append(node.attr)
        node = node.value
    return names[::-1] if _is_manager(node) else None


def manager_pokes(path: Path) -> list[str]:
    """Lines of ``path`` that reach into a TierManager's insides: a private name of it or of a part,
    the index or policies of its block table, its job book's queue, or any write to an attribute of
    the manager or of a part (an assignment, or a write into one of their dicts). Calling a part's
    public methods and reading its public attributes is how callers talk to the manager."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = _after_manager(node) if isinstance(node, ast.Attribute) else None
        if names and (names[-1].startswith("_") or tuple(names[:2]) in PART_INSIDES and len(names) == 2):
            found.append(f"{path.name}:{node.lineno} reads manager.{'.'.join(names)}")
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            while isinstance(target, ast.Subscript):
                target = target.value
            written = _after_manager(target) if isinstance(target, ast.Attribute) else None
            if written:
                found.append(f"{path.name}:{node.lineno} writes manager.{'.'.join(written)}")
    return sorted(found)


def test_the_poke_finder_finds_pokes(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("self.manager.telemetry.counters['x'] += 1\nmanager.pressure.cost = 3\n"
                     "rows = self.manager.table.index.col\nmanager.jobbook.queued.append(1)\n"
                     "manager.views._cache = None\nx = engine.manager._warn_bad_nvme_blocks\nmanager.turns = 1\n"
                     "self.manager.telemetry.count('x')\nn = manager.table.slots.free_slots\n"
                     "job = manager.planner.pin('s')\nwarnings = manager.telemetry.warnings\n")
    assert [line.split(" ", 1)[1] for line in manager_pokes(probe)] == [
        "writes manager.telemetry.counters", "writes manager.pressure.cost", "reads manager.table.index",
        "reads manager.jobbook.queued", "reads manager.views._cache", "writes manager.views._cache",
        "reads manager._warn_bad_nvme_blocks", "writes manager.turns"]


def test_connector_and_admin_plane_use_the_managers_parts():
    """The vLLM scheduler half, the admin plane and the engine call the manager's parts (``telemetry.count``,
    ``table.peek``, ``planner.pin``...) and read what they show, so each part's state changes in one place."""
    roots = [CORE.parent / "plugins", CORE / "control"]
    files = [p for root in roots for p in root.rglob("*.py")] + [CORE / "engine.py", CORE / "launch" / "serve.py"]
    pokes = [poke for path in files for poke in manager_pokes(path)]
    assert pokes == []
