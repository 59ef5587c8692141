"""The shape the code keeps: a folder per role, small modules and functions, no class spread over files."""
from __future__ import annotations

import ast
from pathlib import Path

import kvtier

CORE = Path(kvtier.__file__).parent
REPO = CORE.parent
SOURCES = [p for p in CORE.rglob("*.py") if "bench" not in p.relative_to(CORE).parts] + \
    list((REPO / "tui").rglob("*.py")) + list((REPO / "plugins").rglob("*.py"))


def _name(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def long_functions(paths, limit=80) -> list[str]:
    out = []
    for path in paths:
        for fn in _functions(ast.parse(path.read_text())):
            if fn.end_lineno - fn.lineno + 1 > limit:
                out.append(f"{_name(path)}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)")
    return out


def host_typed_methods(paths) -> list[str]:
    """Methods whose ``self`` is annotated with a class: a mixin's method written for its host."""
    out = []
    for path in paths:
        for fn in _functions(ast.parse(path.read_text())):
            args = fn.args.posonlyargs + fn.args.args
            if args and args[0].arg == "self" and args[0].annotation is not None:
                out.append(f"{_name(path)}:{fn.lineno} {fn.name}")
    return out


def test_the_shape_checks_find_what_they_look_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("class A:\n    def f(self: 'Host'):\n        pass\n\n\ndef g():\n" + "    x = 1\n" * 81)
    assert [line.split(" ", 1)[1] for line in host_typed_methods([probe])] == ["f"]
    assert len(long_functions([probe])) == 1 and long_functions([probe], limit=90) == []


def test_at_most_eight_modules_at_the_root():
    assert len(list(CORE.glob("*.py"))) <= 8, sorted(p.name for p in CORE.glob("*.py"))


def test_every_package_states_its_rule():
    missing = [str(p.relative_to(REPO)) for p in SOURCES if p.name == "__init__.py"
               and ast.get_docstring(ast.parse(p.read_text())) is None]
    assert missing == []


def test_no_module_over_500_lines():
    big = {str(p.relative_to(REPO)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > 500}
    assert big == {}


def test_no_function_over_80_lines():
    assert long_functions(SOURCES) == []


def test_no_method_written_for_another_class():
    assert host_typed_methods(SOURCES) == []
