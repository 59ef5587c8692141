"""Typed kvtier settings and where each one came from.

This module owns the :class:`Settings` dataclass, size parsing (``"8GiB"``), the lookup
of ``kvtier.toml`` and the precedence rule: command-line flag > ``KVTIER_*`` environment
variable > ``kvtier.toml`` > built-in default.  :func:`load_settings` returns the settings
together with a field -> source map (``"flag"``, ``"env KVTIER_DRAM"``, ``"file <path>"``,
``"default"``) so that ``kvtier config`` can show, and errors can name, where a value came
from.  All validation lives in :func:`validate_settings`.  Stdlib only; never imports torch.

The two budgets (``dram``, ``nvme``) may be ``auto``, and are when nothing sets them: ``kvtier
serve`` then sizes them to the box at start (``kvtier.launch.budgets.size_budgets``), because no
fixed default fits every disk and every number of servers on it.  Their field then holds the
built-in default, which is the cap of the automatic budget, and :func:`auto_budgets` names them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import get_type_hints

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from kvtier.errors import ConfigError

__all__ = [
    "Settings",
    "parse_size",
    "load_settings",
    "validate_settings",
    "find_config_file",
    "default_cache_dir",
    "ENV_PREFIX",
    "POLICIES",
    "DIRECT_IO_MODES",
    "write_behind_seconds",
    "AUTO",
    "auto_budgets",
]

ENV_PREFIX = "KVTIER_"
POLICIES = ("lru", "arc")
DIRECT_IO_MODES = ("auto", "on", "off")
GiB = 2**30
SIZE_HINT = "use a size such as 8GiB or 512MiB"
AUTO = "auto"  # a budget kvtier serve sizes to the box (the default of both budgets)
_AUTO_SOURCE = " (auto)"  # suffix of the source of a budget set to "auto" explicitly

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?|b)?$", re.IGNORECASE)
# Friendlier spellings accepted in the environment (KVTIER_DRAM) and in kvtier.toml (dram).
_ALIASES = {"dram": "dram_bytes", "nvme": "nvme_bytes"}
_SIZE_FIELDS = ("dram_bytes", "nvme_bytes")
_PATH_FIELDS = ("nvme_dir", "snapshot_dir")
_ENUMS = {"policy": POLICIES, "direct_io": DIRECT_IO_MODES, "shared_policy": ("write-through", "demote")}


def default_cache_dir(env: Mapping[str, str] | None = None) -> str:
    """Return ``$XDG_CACHE_HOME/kvtier`` (``~/.cache/kvtier`` when unset)."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvtier")


@dataclass(frozen=True)
class Settings:
    """Every kvtier knob, already parsed to its final type."""

    # The budgets' defaults are the caps of kvtier serve's automatic budgets (and what a connector
    # configured by hand gets): unset, or "auto", kvtier serve sizes them to the box, never above these.
    dram_bytes: int = 4 * GiB
    nvme_dir: str = field(default_factory=lambda: os.path.join(default_cache_dir(), "nvme"))
    nvme_bytes: int = 64 * GiB
    snapshot_dir: str = field(default_factory=lambda: os.path.join(default_cache_dir(), "snapshots"))
    policy: str = "lru"
    high_watermark: float = 0.90
    low_watermark: float = 0.75
    io_threads: int = 8  # NVMe queue depth: parallel IOs are what an SSD needs
    direct_io: str = "auto"
    warm_codec: str = "none"
    cold_codec: str = "none"
    link_gbps: str = ""  # caps on measured link rates for the cost model, e.g. "pcie=3.9,nvme=1.5" (GB/s)
    rates_refresh: float = 300.0  # seconds between re-measurements of the links once the engine is quiet; 0: never
    write_behind: str = "10"  # seconds a DRAM-only block may wait for its NVMe copy, or "off"
    stop_timeout: float = 60.0  # kvtier serve: seconds the flush on stop may take before vLLM stops anyway
    shared: str = ""  # the shared tier: redis://host:port/db, rediss://, unix:///path ("" = none)
    shared_policy: str = "write-through"  # blocks go to the shared tier when stored (or "demote": when cold)
    shared_codec: str = "none+zstd"  # codec of blocks in the shared tier (compressed: the network is cheaper)
    shared_ttl: float = 86400.0  # seconds a published block or session lives in the store
    shared_auth_file: str = ""  # file (mode 600) with the store's password (or user name, then password)
    shared_ca_file: str = ""  # CA certificate of a rediss:// store


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
_KINDS = {name: hint.__name__ for name, hint in get_type_hints(Settings).items()}
_KIND_WORDS = {"int": "a whole number", "float": "a number", "str": "a string"}


def write_behind_seconds(text: str | float | int | None) -> float | None:
    """``"10"`` -> 10.0, ``"2.5s"`` -> 2.5, ``"off"`` -> None (no write-behind)."""
    value = str(text if text is not None else "off").strip().lower().removesuffix("s")
    if value in ("off", "no", "false", "none", "of"):
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(f"invalid write_behind {text!r}",
                          hint="seconds a DRAM-only block may wait for its NVMe copy (e.g. 10), or off") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"invalid write_behind {text!r}: must be 0 or more seconds", hint="e.g. 10, or off")
    return seconds


def auto_budgets(sources: Mapping[str, str]) -> frozenset[str]:
    """The budget fields (``dram_bytes``, ``nvme_bytes``) that are automatic: set nowhere, or set to
    ``auto`` (by a flag, ``KVTIER_DRAM=auto`` or ``nvme = "auto"`` in kvtier.toml)."""
    return frozenset(name for name in _SIZE_FIELDS
                     if sources.get(name, "default") == "default" or sources[name].endswith(_AUTO_SOURCE))


def _is_auto(value: object) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def parse_size(text: str | int | float) -> int:
    """Parse a byte size: ``4096``, ``"8GiB"``, ``"8G"``, ``"1.5 gb"`` (K/M/G/T are powers of 2)."""
    if isinstance(text, bool):
        raise ConfigError(f"invalid size {text!r}", hint=SIZE_HINT)
    if isinstance(text, (int, float)):
        if not math.isfinite(text) or text < 0:
            raise ConfigError(f"invalid size {text!r}: must be a non-negative number of bytes", SIZE_HINT)
        return int(text)
    if not isinstance(text, str):
        raise ConfigError(f"invalid size {text!r}: expected a string or a number", hint=SIZE_HINT)
    match = _SIZE_RE.match(text.strip())
    if match is None:
        raise ConfigError(f"invalid size {text!r}", hint=SIZE_HINT)
    number, prefix = match.group(1), (match.group(2) or "").lower()
    return int(Fraction(number) * _UNITS[prefix])


def _coerce(name: str, value: object, source: str) -> object:
    """Convert a raw flag/env/toml value to the type of field ``name``."""
    kind = _KINDS[name]
    try:
        if name in _SIZE_FIELDS:
            return parse_size(value)  # type: ignore[arg-type]
        if isinstance(value, bool):
            raise ValueError("expected a value, not true/false")
        if kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("expected a whole number")
            return int(value.strip() if isinstance(value, str) else value)  # type: ignore[arg-type]
        if kind == "float":
            return float(value.strip() if isinstance(value, str) else value)  # type: ignore[arg-type]
        if name == "nvme_dir" and isinstance(value, (list, tuple)):  # one directory per drive
            if not value or not all(isinstance(v, (str, os.PathLike)) and os.fspath(v).strip() for v in value):
                raise ValueError("expected a list of directories, one per drive")
            value = os.pathsep.join(os.fspath(v).strip() for v in value)
        if not isinstance(value, (str, os.PathLike)):
            raise ValueError("expected a string")
        text = os.fspath(value).strip()
        if name == "nvme_dir":  # "/a:/b": the drives, like PATH
            return os.pathsep.join(os.path.expanduser(p.strip()) for p in text.split(os.pathsep) if p.strip())
        if name in _PATH_FIELDS:
            return os.path.expanduser(text)
        return text.lower() if name in _ENUMS else text
    except ConfigError as exc:
        hint = f"{exc.hint}, or auto (sized to the box at start)" if name in _SIZE_FIELDS else exc.hint
        raise ConfigError(f"invalid {name} {value!r} (from {source}): {exc.message}", hint) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"invalid {name} {value!r} (from {source}): {exc}", hint=f"{name} must be {_KIND_WORDS[kind]}"
        ) from None


def validate_settings(settings: Settings, sources: Mapping[str, str] | None = None) -> None:
    """Check every cross-field and range rule; raise ConfigError naming key and source."""
    sources = sources or {}

    def fail(name: str, why: str, hint: str) -> None:
        value = getattr(settings, name)
        source = sources.get(name, "default")
        raise ConfigError(f"invalid {name} {value!r} (from {source}): {why}", hint=hint)

    for name in _SIZE_FIELDS:
        if getattr(settings, name) <= 0:
            fail(name, "must be greater than zero", SIZE_HINT)
    for name, allowed in _ENUMS.items():
        if getattr(settings, name) not in allowed:
            fail(name, "unknown value", f"choose one of: {', '.join(allowed)}")
    for name in ("high_watermark", "low_watermark"):
        if not 0.0 < getattr(settings, name) <= 1.0:
            fail(name, "must be in (0, 1]", "use a fraction such as 0.9")
    if settings.low_watermark >= settings.high_watermark:
        fail("low_watermark", f"must be below high_watermark ({settings.high_watermark})",
             "e.g. low_watermark = 0.75 with high_watermark = 0.90")
    if not 1 <= settings.io_threads <= 64:
        fail("io_threads", "must be between 1 and 64", "use e.g. io_threads = 4")
    try:
        write_behind_seconds(settings.write_behind)
    except ConfigError as exc:
        fail("write_behind", exc.message.split(": ", 1)[-1] if ": " in exc.message else "unknown value",
             exc.hint or "e.g. 10, or off")
    if not 0 <= settings.rates_refresh <= 86400:
        fail("rates_refresh", "must be between 0 (never) and 86400 seconds", "e.g. rates_refresh = 300")
    if not 0 <= settings.stop_timeout <= 86400:
        fail("stop_timeout", "must be between 0 and 86400 seconds", "e.g. stop_timeout = 60")
    for name in _PATH_FIELDS + ("warm_codec", "cold_codec"):
        if not getattr(settings, name):
            fail(name, "must not be empty", f"set {name} or leave it unset for the default")
    from kvtier.codecs import CODEC_HELP, SPEC_RE

    for name in ("warm_codec", "cold_codec", "shared_codec"):
        if not SPEC_RE.match(str(getattr(settings, name)).strip().lower()):
            fail(name, "unknown codec", f"codecs: {CODEC_HELP}")
    if not 1 <= settings.shared_ttl <= 365 * 86400:
        fail("shared_ttl", "must be between 1 second and a year", "e.g. shared_ttl = 86400 (a day)")
    if settings.shared:
        from kvtier.errors import UsageError as _Usage
        from kvtier.tiers.shared.config import parse_shared_url

        try:
            parse_shared_url(settings.shared)
        except _Usage as exc:  # not echoing the value: it may hold a password
            raise ConfigError(f"invalid shared (from {sources.get('shared', 'default')}): {exc.message}",
                              hint=exc.hint) from None
    from kvtier.errors import UsageError
    from kvtier.plan.costmodel import parse_link_caps

    try:
        parse_link_caps(settings.link_gbps)
    except UsageError as exc:
        fail("link_gbps", exc.message, exc.hint or "e.g. link_gbps = \"pcie=3.9\"")


def find_config_file(env: Mapping[str, str] | None = None) -> Path | None:
    """Locate kvtier.toml: ``$KVTIER_CONFIG``, else ``./kvtier.toml``, else the XDG config dir."""
    env = os.environ if env is None else env
    if env.get("KVTIER_CONFIG"):
        return Path(env["KVTIER_CONFIG"]).expanduser()
    local = Path("kvtier.toml")
    if local.is_file():
        return local
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    user = Path(base) / "kvtier" / "kvtier.toml"
    return user if user.is_file() else None


def _read_toml(path: Path) -> dict[str, object]:
    """Read kvtier.toml into field name -> raw value, resolving the dram/nvme aliases."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist",
                          hint="fix the path or unset KVTIER_CONFIG") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}",
                          hint="check the file is valid TOML (key = value lines)") from None
    raw: dict[str, object] = {}
    for key, value in data.items():
        name = _ALIASES.get(key, key)
        if name not in _FIELDS:
            valid = ", ".join(sorted([*_FIELDS, *_ALIASES]))
            raise ConfigError(f"unknown key {key!r} in config file {path}", hint=f"valid keys: {valid}")
        if name in raw:
            raise ConfigError(f"{name} is set twice in config file {path} (via {key!r})",
                              hint=f"keep only one of {name!r} and its alias")
        raw[name] = value
    return raw


def _env_layer(env: Mapping[str, str]) -> dict[str, tuple[object, str]]:
    """Collect field -> (raw value, source) from KVTIER_* variables; canonical names beat aliases."""
    layer: dict[str, tuple[object, str]] = {}
    names = [(ENV_PREFIX + alias.upper(), name) for alias, name in _ALIASES.items()]
    names += [(ENV_PREFIX + name.upper(), name) for name in _FIELDS]
    for var, name in names:
        value = env.get(var)
        if value is not None and value.strip() != "":
            layer[name] = (value, f"env {var}")
    return layer


def _flag_layer(flags: Mapping[str, object]) -> dict[str, tuple[object, str]]:
    """Collect field -> (raw value, "flag") from flags, skipping ones left as None."""
    layer: dict[str, tuple[object, str]] = {}
    for key, value in flags.items():
        if value is None:
            continue
        name = _ALIASES.get(key, key)
        if name not in _FIELDS:
            raise ConfigError(f"unknown setting {key!r}", hint=f"valid settings: {', '.join(_FIELDS)}")
        layer[name] = (value, "flag")
    return layer


def load_settings(
    flags: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    toml_path: str | os.PathLike[str] | None = None,
) -> tuple[Settings, dict[str, str]]:
    """Merge defaults < kvtier.toml < KVTIER_* env < flags; return settings and field -> source."""
    env = os.environ if env is None else env
    path = Path(toml_path) if toml_path is not None else find_config_file(env)
    cache = default_cache_dir(env)
    values: dict[str, object] = dataclasses.asdict(Settings(
        nvme_dir=os.path.join(cache, "nvme"), snapshot_dir=os.path.join(cache, "snapshots")))
    sources = dict.fromkeys(values, "default")
    layers: list[dict[str, tuple[object, str]]] = []
    if path is not None:
        layers.append({k: (v, f"file {path}") for k, v in _read_toml(path).items()})
    layers += [_env_layer(env), _flag_layer(flags or {})]
    for layer in layers:
        for name, (raw, source) in layer.items():
            if name in _SIZE_FIELDS and _is_auto(raw):  # sized at start; the field keeps the cap
                values[name], sources[name] = _FIELDS[name].default, source + _AUTO_SOURCE
                continue
            values[name] = _coerce(name, raw, source)
            sources[name] = source
    settings = Settings(**values)  # type: ignore[arg-type]
    validate_settings(settings, sources)
    return settings, sources
