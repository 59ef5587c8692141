"""The vLLM API check: does kvtier's connector fit a given vLLM source tree? Read, never imported.

A vLLM release can rename a connector hook, change a hook's parameters, move an internal kvtier
imports or drop a request field kvtier reads; each shows up only when that code path runs, often as
a traceback in a worker process. This check finds them statically with ``ast`` (a vLLM wheel needs
its own torch, so a release that cannot be imported here can still be checked from its unpacked
sources):

* every method kvtier's classes override exists in vLLM's base classes, of the same kind
  (method, classmethod, property), and accepts every call the base's signature allows;
* every abstract hook of those bases is implemented;
* every vLLM internal kvtier uses exists (its module file, the name at its top level or as a class
  member);
* every field of vLLM's objects kvtier reads exists (a class-level field, or an attribute set on
  ``self`` in one of its methods, its bases in the same module included);
* the hooks the release has beyond the ones kvtier was written against are listed, overridden or not.

What kvtier uses is described by ``kvtier.plugins.vllm.compat.api_spec()``; the CLI passes it in
(the core never imports the connector).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = ["VllmSource", "check_api", "Signature", "parse_version"]


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """(major, minor, patch) of a version string such as ``0.33.0+cu130`` or ``0.32.1.dev3``."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(part or 0) for part in match.groups()) if match else None


# ---- reading a source tree --------------------------------------------------------------------------
class VllmSource:
    """A ``vllm`` package directory (an installed one, or an unpacked wheel), parsed on demand."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._trees: dict[str, ast.Module | None] = {}

    def module_file(self, module: str) -> Path | None:
        parts = module.split(".")[1:]  # "vllm.a.b" -> a/b.py or a/b/__init__.py
        for path in (self.root.joinpath(*parts).with_suffix(".py") if parts else None,
                     self.root.joinpath(*parts, "__init__.py")):
            if path is not None and path.is_file():
                return path
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self.module_file(module)
            self._trees[module] = ast.parse(path.read_text(), filename=str(path)) if path else None
        return self._trees[module]

    @cached_property
    def version(self) -> str | None:
        """``__version__`` from ``vllm/_version.py`` (what the wheel was built as)."""
        tree = self.tree("vllm._version")
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__version__"
                                                    for t in node.targets):
                if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                    return node.value.value
        return None


def _walk_body(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements at one level, those inside ``if``/``try``/``with`` blocks included (``TYPE_CHECKING``
    imports, platform fallbacks)."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (getattr(node, "body", []), getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                yield from _walk_body(block)
            for handler in getattr(node, "handlers", []):
                yield from _walk_body(handler.body)


def _target_names(target: ast.expr) -> set[str]:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return {name for element in target.elts for name in _target_names(element)}
    return set()


def top_level_names(tree: ast.Module) -> set[str]:
    """What ``from module import NAME`` can find: definitions, assignments (annotated ones too),
    imports, and the names a module-level ``__getattr__`` compares against (lazy attributes)."""
    names: set[str] = set()
    for node in _walk_body(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if node.name == "__getattr__":
                names |= {c.value for cmp in ast.walk(node) if isinstance(cmp, ast.Compare)
                          for c in ast.walk(cmp) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names |= _target_names(target)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            names |= _target_names(node.target)
        elif isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def find_class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    for node in _walk_body(tree.body):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """Attributes its methods set on ``self`` (``self.x = ...``, ``self.x: T = ...``)."""
    found = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for element in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name) and \
                        element.value.id == "self":
                    found.add(element.attr)
    return found


def class_members(tree: ast.Module, name: str, _seen: frozenset[str] = frozenset()) -> set[str] | None:
    """A class's members: its body's definitions and fields, what its methods set on ``self``, and
    the same of its bases defined in the same module. None when the class is not there."""
    cls = find_class(tree, name)
    if cls is None:
        return None
    members = set(_self_attributes(cls))
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                members |= _target_names(target)
        elif isinstance(node, ast.AnnAssign):
            members |= _target_names(node.target)
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id not in _seen:
            members |= class_members(tree, base.id, _seen | {name}) or set()
    return members


# ---- signatures -------------------------------------------------------------------------------------
@dataclass
class Signature:
    """What calls a method accepts (``self``/``cls`` left out)."""

    kind: str  # method | classmethod | staticmethod | property
    positional: list[str] = field(default_factory=list)
    defaults: set[str] = field(default_factory=set)  # parameters with a default
    kwonly: list[str] = field(default_factory=list)
    varargs: bool = False
    varkw: bool = False
    abstract: bool = False

    @classmethod
    def of(cls, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> "Signature":
        decorators = {d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else ""
                      for d in fn.decorator_list}
        kind = next((k for k in ("property", "classmethod", "staticmethod") if k in decorators), "method")
        args = fn.args
        positional = [a.arg for a in args.posonlyargs + args.args]
        if kind != "staticmethod" and positional:
            positional = positional[1:]
        defaults = set(positional[len(positional) - len(args.defaults):]) if args.defaults else set()
        defaults |= {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}
        return cls(kind, positional, defaults, [a.arg for a in args.kwonlyargs], args.vararg is not None,
                   args.kwarg is not None, "abstractmethod" in decorators)

    def accepts_calls_of(self, base: "Signature") -> str | None:
        """Why a call that ``base`` allows could fail on this override (None: every one works)."""
        if self.kind != base.kind:
            return f"a {self.kind} in kvtier, a {base.kind} in vLLM"
        if self.kind == "property":
            return None
        for i, name in enumerate(base.positional):
            if i < len(self.positional):
                if self.positional[i] != name:
                    return f"parameter {i + 1} is `{name}` in vLLM, `{self.positional[i]}` in kvtier"
                if name in base.defaults and name not in self.defaults:
                    return f"vLLM may leave out `{name}`; kvtier requires it"
            elif not (self.varargs and (self.varkw or name in self.kwonly)):
                return f"vLLM passes `{name}`; kvtier does not accept it"
        for name in base.kwonly:
            if name not in self.positional and name not in self.kwonly and not self.varkw:
                return f"vLLM passes `{name}=`; kvtier does not accept it"
        if base.varargs and not self.varargs:
            return "vLLM may pass more positional arguments (*args); kvtier does not accept them"
        if base.varkw and not self.varkw:
            return "vLLM may pass more keyword arguments (**kwargs); kvtier does not accept them"
        accepted = set(base.positional) | set(base.kwonly)
        extra = [n for n in self.positional + self.kwonly if n not in accepted and n not in self.defaults]
        if extra:
            return f"kvtier requires `{extra[0]}`, which vLLM never passes"
        return None


def _methods(cls: ast.ClassDef) -> dict[str, Signature]:
    return {node.name: Signature.of(node) for node in cls.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _is_hook(name: str) -> bool:
    return not name.startswith("_") or name == "__init__"


# ---- the check --------------------------------------------------------------------------------------
@dataclass
class Row:
    what: str  # override | abstract | internal | field | new hook
    name: str
    ok: bool
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "name": self.name, "ok": self.ok, "detail": self.detail}


def _override_rows(source: VllmSource, spec: Mapping[str, Any], version: tuple[int, ...] | None) -> list[Row]:
    rows: list[Row] = []
    ours_tree = ast.parse(Path(spec["connector_file"]).read_text())
    later = {name: parse_version(v) for name, v in spec.get("later_hooks", {}).items()}
    for ours_name, base_module, base_names in spec["subclasses"]:
        ours_cls = find_class(ours_tree, ours_name)
        if ours_cls is None:
            raise ValueError(f"{spec['connector_file']} has no class {ours_name}")
        base_tree = source.tree(base_module)
        bases = [find_class(base_tree, name) if base_tree is not None else None for name in base_names]
        missing = [name for name, cls in zip(base_names, bases) if cls is None]
        if missing:
            rows.append(Row("override", f"{ours_name}({', '.join(base_names)})", False,
                            f"{base_module} has no class {', '.join(missing)}"))
            continue
        hooks: dict[str, Signature] = {}
        for cls in bases:
            for name, signature in _methods(cls).items():
                hooks.setdefault(name, signature)
        ours = {n: s for n, s in _methods(ours_cls).items() if _is_hook(n) and n not in spec.get("own_members", ())}
        for name, signature in ours.items():
            qual = f"{ours_name}.{name}"
            base = hooks.get(name)
            if base is None:
                added = later.get(name)
                if added and version is not None and version < added:
                    rows.append(Row("override", qual, True, f"not in this release (added in "
                                    f"{'.'.join(map(str, added))}): never called"))
                else:
                    rows.append(Row("override", qual, False, f"not a hook of {'/'.join(base_names)}: renamed or "
                                    "removed in this release"))
                continue
            why = signature.accepts_calls_of(base)
            rows.append(Row("override", qual, why is None, why or f"{signature.kind}, parameters match"))
        for name, base in hooks.items():
            if base.abstract and name not in ours:
                rows.append(Row("abstract", f"{ours_name}.{name}", False,
                                f"abstract in {'/'.join(base_names)}; kvtier does not implement it"))
        if ours_name == spec.get("connector_class"):
            rows += _new_hook_rows(hooks, ours, spec)
    return rows


def _new_hook_rows(hooks: Mapping[str, Signature], ours: Mapping[str, Signature], spec: Mapping[str, Any]) -> list[Row]:
    known = set(spec.get("known_hooks", ()))
    return [Row("new hook", name, True, "overridden by kvtier" if name in ours else "kvtier keeps vLLM's default")
            for name in sorted(hooks) if _is_hook(name) and name not in known]


def _internal_rows(source: VllmSource, spec: Mapping[str, Any]) -> list[Row]:
    rows = []
    for module, name, use in spec.get("internals", ()):
        tree = source.tree(module)
        owner, _, member = name.partition(".")
        if tree is None:
            ok, detail = False, f"module {module} is gone"
        elif owner not in top_level_names(tree):
            ok, detail = False, f"{module} no longer defines {owner}"
        elif member and member not in (class_members(tree, owner) or set()):
            ok, detail = False, f"{module}.{owner} has no member {member}"
        else:
            ok, detail = True, use
        rows.append(Row("internal", f"{module}.{name}", ok, detail))
    return rows


def _field_rows(source: VllmSource, spec: Mapping[str, Any]) -> list[Row]:
    rows = []
    for module, cls, names in spec.get("fields", ()):
        tree = source.tree(module)
        members = class_members(tree, cls) if tree is not None else None
        if members is None:
            rows.append(Row("field", f"{module}.{cls}", False, f"class {cls} is not in {module}"))
            continue
        for name in names:
            rows.append(Row("field", f"{cls}.{name}", name in members, "" if name in members else
                            f"{cls} has no field or attribute {name}"))
    return rows


def check_api(vllm_dir: str | Path, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The check's report: ``ok``, the source's ``version``, every ``row`` and the ``problems``
    (one line each). ``spec``: ``kvtier.plugins.vllm.compat.api_spec()``."""
    source = VllmSource(vllm_dir)
    if source.module_file(spec["subclasses"][0][1]) is None:
        from kvtier.errors import UsageError

        raise UsageError(f"{vllm_dir} is not a vLLM package directory (no {spec['subclasses'][0][1]})",
                         hint="give the `vllm` directory itself, e.g. an unpacked wheel's vllm/")
    version = parse_version(source.version)
    rows = _override_rows(source, spec, version) + _internal_rows(source, spec) + _field_rows(source, spec)
    problems = [f"{row.name}: {row.detail}" for row in rows if not row.ok]
    return {"source": str(source.root), "version": source.version, "ok": not problems,
            "rows": [row.to_dict() for row in rows], "problems": problems,
            "new_hooks": [row.name for row in rows if row.what == "new hook"]}
