"""The shape the code keeps: a folder per role, short functions, a docstring per module saying what it
owns, no class spread over files, and no facade: a member that only forwards to a part says the
caller should hold the part (../shared/design/STYLE.md)."""
from __future__ import annotations

import ast
from pathlib import Path

import kvtier

CORE = Path(kvtier.__file__).parent
REPO = CORE.parent
SOURCES = list(CORE.rglob("*.py")) + list((REPO / "tui").rglob("*.py")) + list((REPO / "plugins").rglob("*.py"))

# Forwards that implement a contract other code implements too: the caller holds the store behind the
# contract (either kind), so it cannot hold the part. (file, class) -> members allowed to forward.
CONTRACTS = {
    # the NVMe tier's surface, which the many-drive ``DriveSet`` implements too (``open_nvme`` returns either)
    ("kvtier/tiers/nvme/store.py", "NvmeStore"): {
        "capacity_bytes", "segment_bytes", "used_bytes", "can_punch", "direct", "io_counts", "disk_bytes",
        "write", "write_batch", "delete", "delete_many", "read_into", "submit_read", "read_batch", "compact"},
    # ``kvtier.move.publish.SharedTier`` (a ``BlockStore`` plus its health), as the mover sees any shared tier
    ("kvtier/tiers/shared/store.py", "SharedStore"): {
        "available", "state", "problem", "write_batch", "read_batch", "delete_many"},
}
MAX_FORWARDS = 2  # per class, beyond its contract


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


def undocumented_modules(paths) -> list[str]:
    return [_name(p) for p in paths if ast.get_docstring(ast.parse(p.read_text())) is None]


# ---- pass-throughs: members that only forward to a part -----------------------------------------------
def _part_member(node: ast.AST) -> bool:
    """``self.<part>.<name>`` (or deeper): a member of something the object holds."""
    depth = 0
    while isinstance(node, ast.Attribute):
        node, depth = node.value, depth + 1
    return isinstance(node, ast.Name) and node.id == "self" and depth >= 2


def _passes_its_parameters(call: ast.Call, fn: ast.FunctionDef) -> bool:
    """The call's arguments are the method's own parameters, in order, unchanged."""
    a = fn.args
    wanted = [p.arg for p in (a.posonlyargs + a.args)[1:]] + ([f"*{a.vararg.arg}"] if a.vararg else []) + \
        [p.arg for p in a.kwonlyargs] + ([f"**{a.kwarg.arg}"] if a.kwarg else [])
    given = []
    for arg in call.args:
        if isinstance(arg, ast.Starred) and isinstance(arg.value, ast.Name):
            given.append(f"*{arg.value.id}")
        elif isinstance(arg, ast.Name):
            given.append(arg.id)
        else:
            return False
    for keyword in call.keywords:
        if not isinstance(keyword.value, ast.Name) or keyword.arg not in (None, keyword.value.id):
            return False
        given.append(f"**{keyword.value.id}" if keyword.arg is None else keyword.arg)
    return given == wanted


def _forwards(fn: ast.FunctionDef) -> bool:
    """``return self.<part>.<name>(<its parameters>)`` (or the call alone), ``return self.<part>.<attr>``
    with no parameters, or ``self.<part>.<attr> = <its one parameter>``: a docstring aside, nothing else."""
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    if len(body) != 1:
        return False
    statement = body[0]
    params = [p.arg for p in (fn.args.posonlyargs + fn.args.args)[1:]]
    value = statement.value if isinstance(statement, (ast.Return, ast.Expr)) else None
    if isinstance(value, ast.Call):
        return _part_member(value.func) and _passes_its_parameters(value, fn)
    if isinstance(statement, ast.Return) and value is not None:
        return _part_member(value) and not params and not fn.args.vararg and not fn.args.kwarg
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        return _part_member(statement.targets[0]) and len(params) == 1 and \
            isinstance(statement.value, ast.Name) and statement.value.id == params[0]
    return False


def pass_throughs(path: Path) -> dict[str, list[str]]:
    """Per class of ``path``: its members (a property's getter and setter each) that only forward."""
    out = {}
    for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
        members = [fn.name for fn in cls.body if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and _forwards(fn)]
        if members:
            out[cls.name] = members
    return out


def facades(paths, contracts=CONTRACTS, limit=MAX_FORWARDS) -> dict[str, list[str]]:
    """Classes with more than ``limit`` forwarding members beyond those their contract names."""
    out = {}
    for path in paths:
        for cls, members in pass_throughs(path).items():
            extra = [m for m in members if m not in contracts.get((_name(path), cls), set())]
            if len(extra) > limit:
                out[f"{_name(path)}:{cls}"] = extra
    return out


PROBE = '''
class Host:
    def __init__(self, part):
        self.part = part

    @property
    def size(self):
        """Forwarded."""
        return self.part.size

    @size.setter
    def size(self, value):
        self.part.size = value

    def get(self, key, default=None):
        return self.part.get(key, default)

    def put(self, *args, **kwargs):
        self.part.inner.put(*args, **kwargs)

    def own(self, key):
        return self.part.get(key.lower())  # more than a forward

    def both(self, key):
        self.part.get(key)
        return self.other.get(key)
'''


def test_the_shape_checks_find_what_they_look_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("class A:\n    def f(self: 'Host'):\n        pass\n\n\ndef g():\n" + "    x = 1\n" * 81)
    assert [line.split(" ", 1)[1] for line in host_typed_methods([probe])] == ["f"]
    assert len(long_functions([probe])) == 1 and long_functions([probe], limit=90) == []
    assert undocumented_modules([probe]) == ["probe.py"]
    probe.write_text('"""What this module owns."""\n')
    assert undocumented_modules([probe]) == []


def test_the_pass_through_finder_finds_forwards(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    assert pass_throughs(probe) == {"Host": ["size", "size", "get", "put"]}
    assert facades([probe]) == {"probe.py:Host": ["size", "size", "get", "put"]}
    assert facades([probe], limit=4) == {}
    assert facades([probe], contracts={("probe.py", "Host"): {"size", "get"}}) == {}


def test_at_most_eight_modules_at_the_root():
    assert len(list(CORE.glob("*.py"))) <= 8, sorted(p.name for p in CORE.glob("*.py"))


def test_every_module_says_what_it_owns():
    assert undocumented_modules(SOURCES) == []


def test_no_function_over_80_lines():
    assert long_functions(SOURCES) == []


def test_no_method_written_for_another_class():
    assert host_typed_methods(SOURCES) == []


def test_callers_hold_the_parts_no_class_forwards_to_them():
    """At most two forwarding members per class: ``manager.telemetry.count(...)``, not ``manager.count(...)``."""
    assert facades(SOURCES) == {}


def test_the_contract_list_names_only_forwards_that_exist():
    """A contract entry whose member stopped forwarding (or went) is stale: the list only shrinks."""
    found = {(_name(p), cls): set(members) for p in SOURCES for cls, members in pass_throughs(p).items()}
    assert {key: sorted(names - found.get(key, set())) for key, names in CONTRACTS.items()
            if names - found.get(key, set())} == {}
