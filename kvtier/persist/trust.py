"""Where a snapshot came from: HMAC signatures with keys the operator controls.

Checksums prove a snapshot is intact, not who wrote it: anyone can write a file with valid
checksums, and its KV would serve every later request with the same prefix. So every snapshot a
kvtier server writes is signed (HMAC-SHA256 over its whole header, which holds every block's
checksum, so the payload is covered too; 16 bytes in the preamble's spare space, which older readers
ignore), and a server restores only snapshots signed by a key it trusts -- unless the operator says
``--trust-unsigned`` for one restore. Keys live in one file, ``$KVTIER_SNAPSHOT_KEYS`` or
``$XDG_CONFIG_HOME/kvtier/snapshot-keys`` (mode 0600, created with one random key on first use):
one hex key per line, the first one signs, all of them verify. Copy the file to the boxes that
should accept each other's snapshots. Stdlib only.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.tiers import fileio

__all__ = ["SIGNATURE_BYTES", "keys_file", "load_keys", "sign", "signing_key", "verify"]

SIGNATURE_BYTES = 16


def keys_file(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("KVTIER_SNAPSHOT_KEYS"):
        return Path(env["KVTIER_SNAPSHOT_KEYS"]).expanduser()
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kvtier" / "snapshot-keys"


def load_keys(env: Mapping[str, str] | None = None) -> list[bytes]:
    """The trusted keys (the first signs); [] when the file does not exist yet."""
    path = keys_file(env)
    try:
        info = path.stat()
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ConfigError(f"cannot read the snapshot keys file {path}: {exc.strerror or exc}",
                          hint="fix its permissions, or point KVTIER_SNAPSHOT_KEYS at another file") from None
    if info.st_mode & 0o077:
        raise ConfigError(f"the snapshot keys file {path} can be read by other users",
                          hint=f"chmod 600 {path}: whoever reads a key can forge snapshots this server trusts")
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            key = bytes.fromhex(line)
        except ValueError:
            key = b""
        if len(key) < 16:
            raise ConfigError(f"{path}:{number}: not a key (at least 32 hex digits)",
                              hint="one hex key per line; `openssl rand -hex 32` makes one")
        keys.append(key)
    return keys


def signing_key(env: Mapping[str, str] | None = None) -> bytes:
    """The key this box signs with, creating the keys file (0600, one random key) on first use."""
    keys = load_keys(env)
    if keys:
        return keys[0]
    path = keys_file(env)
    fileio.mkdir(path.parent, mode=0o700)
    key = secrets.token_bytes(32)
    text = "# kvtier snapshot keys: the first signs, every one verifies (one hex key per line)\n" + key.hex() + "\n"
    try:  # synced with its directory entry: a power cut must not keep snapshots signed by a lost key
        fileio.write_small_file(path, text.encode(), exclusive=True)
    except FileExistsError:  # another process made it meanwhile: use theirs
        return load_keys(env)[0]
    return key


def sign(key: bytes, header: bytes) -> bytes:
    return hmac.new(key, header, hashlib.sha256).digest()[:SIGNATURE_BYTES]


def verify(keys: list[bytes], header: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is a signature of ``header`` by one of ``keys`` (an all-zero one: unsigned)."""
    if not any(signature):
        return False
    return any(hmac.compare_digest(sign(key, header), signature) for key in keys)
