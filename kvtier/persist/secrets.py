"""Secrets kvtier reads: never from a command line (``ps`` shows argv to every user), from a file
only its owner can read, or from the environment. Stdlib only."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from kvtier.errors import ConfigError, UsageError

__all__ = ["ADMIN_TOKEN_ENV", "admin_token", "read_private_file"]

ADMIN_TOKEN_ENV = "KVTIER_ADMIN_TOKEN"


def read_private_file(path: str | os.PathLike, what: str, hint: str, error: type = ConfigError) -> str:
    """The text of a file that only its owner may read (mode 600 or stricter); ``error`` (with
    ``hint``) when it cannot be read or others could read it."""
    path = Path(path).expanduser()
    try:
        info = path.stat()
        text = path.read_text()
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}", hint=hint) from None
    if info.st_mode & 0o077 or info.st_uid != os.getuid():
        raise error(f"{what} {path} can be read by other users", hint=f"chmod 600 {path} (and own it)")
    return text


def admin_token(token_file: str | None, env: Mapping[str, str] | None = None) -> str:
    """The admin TCP listener's bearer token: from a file only its owner can read (``--admin-token-file``)
    or from ``$KVTIER_ADMIN_TOKEN``; never from a command line. It reaches the engine through vLLM's
    environment."""
    env = os.environ if env is None else env
    if token_file:
        token = read_private_file(token_file, "the admin token file",
                                  "create it with a long random string, e.g. `openssl rand -hex 32 > FILE; "
                                  "chmod 600 FILE`", error=UsageError).strip()
    else:
        token = str(env.get(ADMIN_TOKEN_ENV, "")).strip()
    if len(token) < 16:
        raise UsageError("--admin-tcp needs a bearer token of at least 16 characters",
                         hint=f"set {ADMIN_TOKEN_ENV} or pass --admin-token-file FILE (mode 600); "
                              "`openssl rand -hex 32` makes one")
    return token
