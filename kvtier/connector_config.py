"""The connector's configuration, typed and parsed once.

vLLM hands a KV connector one JSON object (``kv_connector_extra_config``); ``kvtier serve`` writes it
(``ConnectorConfig.to_extra``) and both halves of the connector, in every process, read it back
(``ConnectorConfig.from_extra``) -- the one place its keys, types and defaults live. Defaults are the
``Settings`` defaults, so a connector in a hand-written vLLM command line behaves as ``kvtier serve``
does. Unknown keys are refused with the list of known ones (a typo must not silently change nothing).
Stdlib only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from kvtier.config import Settings
from kvtier.errors import ConfigError

__all__ = ["ConnectorConfig"]

_DEFAULTS = Settings.__dataclass_fields__
_ALWAYS = {"dram_bytes", "nvme_dir", "nvme_bytes", "policy", "high_watermark", "low_watermark", "io_threads",
           "direct_io", "warm_codec", "cold_codec", "link_gbps", "write_behind"}


def _default(name: str) -> Any:
    return _DEFAULTS[name].default


def _flag(value: Any) -> bool:
    return str(value).strip().lower() not in ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class ConnectorConfig:
    # tiers
    dram_bytes: int = _default("dram_bytes")  # the box's DRAM budget (split across tensor-parallel ranks)
    nvme_dir: str | None = None  # the cold tier's directory; None: no NVMe tier
    nvme_bytes: int = 0  # the box's NVMe budget (split across ranks); 0: no NVMe tier
    policy: str = _default("policy")
    high_watermark: float = _default("high_watermark")
    low_watermark: float = _default("low_watermark")
    io_threads: int = _default("io_threads")
    direct_io: str = _default("direct_io")
    warm_codec: str = _default("warm_codec")
    cold_codec: str = _default("cold_codec")
    write_behind: str = _default("write_behind")  # seconds, or "off"
    catalog: bool = True  # the session catalog next to the NVMe tier (sessions survive restarts)
    catalog_interval_s: float = 1.0  # how often changed sessions are written to it
    # cost model
    link_gbps: str = _default("link_gbps")  # caps, e.g. "pcie=3.9,nvme=1.5" (the worker paces loads to them)
    measure_links: bool = True  # measure link rates at start (off: defaults, for tests)
    rates_refresh_s: float = 300.0  # re-measure while serving (0: never)
    always_load: bool = False  # store and load every hit whatever the cost model says (quality benchmarks)
    synchronous: bool = False  # transfers on the step path (debugging, tests)
    # identity and admin plane (kvtier serve sets them)
    model_id: str | None = None  # the name blocks and snapshots are filed under
    instance: str | None = None
    revision: str | None = None
    commit: str | None = None
    admin_socket: str | None = None
    admin_tcp: str | None = None  # loopback HOST:PORT; its token comes from $KVTIER_ADMIN_TOKEN
    admin_token: str | None = None  # for hand-written vLLM command lines only (kvtier serve never writes it)
    api_url: str | None = None  # vLLM's own API (an idle engine is woken through it)
    snapshot_dir: str | None = None
    # the shared tier (kvtier.tiers.shared.store.SharedConfig reads these)
    shared: str | None = None
    shared_policy: str = _default("shared_policy")
    shared_codec: str = _default("shared_codec")
    shared_ttl_s: int = int(_default("shared_ttl"))
    shared_timeout_s: float = 0.5
    shared_auth_file: str | None = None
    shared_ca_file: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "ConnectorConfig":
        """Parse vLLM's ``kv_connector_extra_config``: each known key converted to its type (a bad
        value is a ``ConfigError`` naming the key), unknown keys refused."""
        extra = dict(extra or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(f"unknown kvtier connector setting(s): {', '.join(unknown)}",
                              hint=f"known: {', '.join(sorted(known))}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            kind = str(known[name].type)
            if value is None:
                values[name] = None if "None" in kind else known[name].default
                continue
            try:
                if kind.startswith("bool"):
                    values[name] = value if isinstance(value, bool) else _flag(value)
                elif kind.startswith("int"):
                    values[name] = int(value)
                elif kind.startswith("float"):
                    values[name] = float(value)
                else:
                    values[name] = str(value) if value != "" or "None" not in kind else None
            except (TypeError, ValueError):
                raise ConfigError(f"kvtier connector setting {name}={value!r} is not a valid {kind.split(' ')[0]}",
                                  hint="see docs/architecture.md (connector configuration)") from None
        return cls(**values)

    def to_extra(self) -> dict[str, Any]:
        """The JSON object vLLM carries to every process: the tier settings always (what the command
        line shows an operator), the rest only where it differs from the default."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or (f.name not in _ALWAYS and value == f.default):
                continue
            out[f.name] = value
        return out

    def shard_budgets(self, shards: int) -> tuple[int, int]:
        """(DRAM bytes, NVMe bytes) of one rank: the budgets are the box's, split across the ranks
        (each rank's arena and files hold its own shard of every block)."""
        return self.dram_bytes // max(1, shards), self.nvme_bytes // max(1, shards)

    @property
    def cold_dir(self) -> str | None:
        """The NVMe tier's directory when the tier is on."""
        return self.nvme_dir if self.nvme_dir and self.nvme_bytes else None
