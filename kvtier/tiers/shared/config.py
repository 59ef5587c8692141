"""How the shared tier is reached and used: its URL (a password in it refused), credentials from a
file or the environment, and ``SharedConfig``. Stdlib only."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import urlsplit, urlunsplit

from kvtier.errors import ConfigError, UsageError

__all__ = ["SHARED_POLICIES", "SharedConfig", "display_url", "load_credentials", "parse_shared_url"]

SHARED_POLICIES = ("write-through", "demote")
SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss", "unix": "unix"}


def parse_shared_url(url: str) -> str:
    """Check a ``--shared`` URL and return it in the form the client takes (``valkey://`` is
    ``redis://``). A password in it is refused: it would sit in argv, ``ps`` and shell history."""
    text = (url or "").strip()
    hint = "e.g. --shared redis://10.0.0.5:6379/0, rediss://host:6380, or unix:///run/valkey.sock"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise UsageError(f"invalid --shared URL {url!r}: {exc}", hint=hint) from None
    scheme = SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise UsageError(f"invalid --shared URL {url!r}: unknown scheme {parts.scheme!r}", hint=hint)
    if parts.password is not None:
        raise UsageError("the --shared URL holds a password; it would be visible in `ps` and shell history",
                         hint="put it in a file named by --shared-auth-file (mode 600), or in "
                              "KVTIER_SHARED_PASSWORD (and KVTIER_SHARED_USERNAME for an ACL user)")
    if scheme == "unix":
        if not parts.path:
            raise UsageError(f"invalid --shared URL {url!r}: no socket path", hint=hint)
    elif not parts.hostname:
        raise UsageError(f"invalid --shared URL {url!r}: no host", hint=hint)
    if port is not None and not 0 < port < 65536:
        raise UsageError(f"invalid --shared URL {url!r}: port {port}", hint=hint)
    db = parts.path.strip("/") if scheme != "unix" else ""
    if db and not db.isdigit():
        raise UsageError(f"invalid --shared URL {url!r}: database {db!r} is not a number", hint=hint)
    if scheme == "unix":  # urlunsplit would drop the "//" of an empty host
        return f"unix://{parts.path}" + (f"?{parts.query}" if parts.query else "")
    return urlunsplit((scheme, parts.netloc, parts.path, parts.query, ""))


def display_url(url: str) -> str:
    """The URL without any user name (what status and logs show)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def load_credentials(auth_file: str | None = None, env: Mapping[str, str] | None = None) -> tuple[str | None,
                                                                                                  str | None]:
    """(username, password) from ``auth_file`` (one line: the password; two lines: user name, then
    password; mode 600 required) or ``KVTIER_SHARED_USERNAME`` / ``KVTIER_SHARED_PASSWORD``."""
    env = os.environ if env is None else env
    if auth_file:
        from kvtier.persist.secrets import read_private_file

        text = read_private_file(auth_file, "--shared-auth-file",
                                 "a file with the password (or a user name line, then the password), mode 600")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if len(lines) not in (1, 2):
            raise ConfigError(f"--shared-auth-file {auth_file}: expected 1 line (password) or 2 (user name, "
                              f"password), found {len(lines)}", hint="one value per line, nothing else")
        return (lines[0] if len(lines) == 2 else env.get("KVTIER_SHARED_USERNAME") or None), lines[-1]
    return env.get("KVTIER_SHARED_USERNAME") or None, env.get("KVTIER_SHARED_PASSWORD") or None


@dataclass(frozen=True)
class SharedConfig:
    """How to reach the store and how to use it (parsed from the connector's extra config)."""

    url: str
    policy: str = "write-through"
    ttl_s: int = 24 * 3600
    timeout_s: float = 0.5
    codec: str = "none+zstd"
    auth_file: str | None = None
    ca_file: str | None = None

    @classmethod
    def from_connector(cls, config) -> "SharedConfig | None":
        """From the connector's ``kvtier.connector_config.ConnectorConfig`` (None: no shared tier)."""
        if not config.shared:
            return None
        if config.shared_policy not in SHARED_POLICIES:
            raise ConfigError(f"unknown shared policy {config.shared_policy!r}",
                              hint=f"one of: {', '.join(SHARED_POLICIES)}")
        return cls(parse_shared_url(config.shared), config.shared_policy, config.shared_ttl_s, config.shared_timeout_s,
                   config.shared_codec, config.shared_auth_file, config.shared_ca_file)
