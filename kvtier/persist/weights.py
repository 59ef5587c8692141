"""A cheap identity of a model's weights, folded into the fingerprint so stale KV is never loaded.

KV depends on the weights, not only on the model's name and shape: a directory whose weights were
replaced in place (a fine-tune, a new revision pulled over the old one) must not be served the KV
the old weights computed. Hashing gigabytes at every start is out of the question, so the identity
covers what changes whenever the weights do, and costs a few small reads:
* ``config.json`` (whole);
* every ``*.safetensors`` file: its name, size and header (the JSON that names every tensor, its
  dtype, shape and byte range, plus any metadata);
* other weight files (``*.bin``, ``*.pt``, ``*.gguf``): name, size and the first and last 64 KiB.
For a hub id the resolved snapshot directory in the local Hugging Face cache is used, its commit hash
(the directory's name) included; when it is not there, the revision string itself (``rev:<name>``).
"""
from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping
from pathlib import Path

__all__ = ["hub_cache_dir", "hub_snapshot", "weights_identity"]

_MAX_HEADER = 64 << 20
_EDGE = 64 << 10
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf")


def weights_identity(model: str | os.PathLike, revision: str | None = None) -> str:
    """16 hex digits naming the weights of ``model`` (a directory, or a hub id); "" if unknown."""
    directory = Path(model).expanduser()
    h = hashlib.blake2b(digest_size=8)
    if not directory.is_dir():
        directory = hub_snapshot(str(model), revision)
        if directory is None:
            return f"rev:{revision}" if revision else ""
        h.update(b"commit\0" + directory.name.encode())  # the snapshot's directory is its commit hash
    config = directory / "config.json"
    if config.is_file():
        h.update(b"config\0" + config.read_bytes())
    for path in sorted(directory.iterdir()):
        if path.suffix == ".safetensors":
            h.update(b"st\0" + path.name.encode() + b"\0" + _safetensors_header(path))
        elif path.suffix in _OTHER_WEIGHTS and path.is_file():
            h.update(b"w\0" + path.name.encode() + b"\0" + _edges(path))
    return h.hexdigest()


def _safetensors_header(path: Path) -> bytes:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            return f"size={size}".encode()
        (length,) = struct.unpack("<Q", raw)
        header = fh.read(min(length, _MAX_HEADER))
    return f"size={size}\0".encode() + header


def _edges(path: Path) -> bytes:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(_EDGE)
        fh.seek(max(0, size - _EDGE))
        tail = fh.read(_EDGE)
    return f"size={size}\0".encode() + hashlib.blake2b(head + tail, digest_size=16).digest()


def hub_cache_dir(env: Mapping[str, str] | None = None) -> str:
    """The Hugging Face hub cache, by the rules huggingface_hub follows (read now, not at its import)."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return str(env["HF_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                              "huggingface")
    return os.path.join(home, "hub")


def hub_snapshot(repo_id: str, revision: str | None, env: Mapping[str, str] | None = None) -> Path | None:
    """The local snapshot directory of a hub model (with its config.json), without touching the network."""
    if repo_id.count("/") > 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, revision=revision, local_files_only=True, cache_dir=hub_cache_dir(env))
    except Exception:  # noqa: BLE001 - not cached (or no huggingface_hub): fall back to the revision
        return None
    return Path(path) if (Path(path) / "config.json").is_file() else None
