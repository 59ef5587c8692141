"""Session entries in the shared store: what another box needs to list a session and restore it
(its ordered block keys, token ids, pin, the box that published it), signed like the blocks.

``SessionEntries`` owns the entry counters (``sessions_published``, ``rejected_entries``); it reaches
the store through a ``SharedClient`` and signs and verifies entries with a ``ValueSigner``."""
from __future__ import annotations

import base64
import time
from collections import Counter
from typing import Sequence

from kvtier.errors import SharedUnavailable
from kvtier.tiers.shared.client import SharedClient
from kvtier.tiers.shared.keys import entry_key, sessions_key
from kvtier.tiers.shared.values import MAC_BYTES, ValueSigner

__all__ = ["SessionEntries", "ENTRY_MAGIC"]

ENTRY_MAGIC = b"KVSS"


class SessionEntries:
    """The session entries (and each model's index of them) that boxes publish, each with the TTL ``ttl_s``."""

    def __init__(self, client: SharedClient, signer: ValueSigner, ttl_s: int = 24 * 3600):
        self.client = client
        self.signer = signer
        self.ttl_s = ttl_s
        self.counters: Counter[str] = Counter()

    def publish_sessions(self, fingerprint: bytes, entries: Sequence[dict]) -> int:
        """Publish session entries (``session_id``, ``namespace``, ``keys``, ``token_ids``, ``num_tokens``,
        ``pinned``, ``box``, ``codec``): what another box needs to list and restore them."""
        if not entries:
            return 0
        import orjson

        ttl, index = self.ttl_s, sessions_key(fingerprint)
        now = time.time()
        blobs = []
        for entry in entries:
            body = orjson.dumps({**entry, "v": 1, "published": now,
                                 "namespace": entry["namespace"].hex(),
                                 "keys": base64.b64encode(b"".join(entry["keys"])).decode(),
                                 "key_len": len(entry["keys"][0]) if entry["keys"] else 0,
                                 "token_ids": base64.b64encode(_tokens_bytes(entry.get("token_ids"))).decode()})
            blobs.append((entry["session_id"], ENTRY_MAGIC + self.signer.mac(body) + body))

        def publish(client):
            pipe = client.pipeline(transaction=False)
            for session_id, blob in blobs:
                pipe.set(entry_key(fingerprint, session_id), blob, ex=ttl)
            pipe.zadd(index, {session_id: now for session_id, _ in blobs})
            pipe.expire(index, ttl)
            return pipe.execute()

        self.client.call(publish)
        self.counters["sessions_published"] += len(blobs)
        return len(blobs)

    def unpublish_session(self, fingerprint: bytes, session_id: str) -> None:
        def remove(client):
            pipe = client.pipeline(transaction=False)
            pipe.delete(entry_key(fingerprint, session_id))
            pipe.zrem(sessions_key(fingerprint), session_id)
            return pipe.execute()

        self.client.call(remove)

    def session_entry(self, fingerprint: bytes, session_id: str) -> dict | None:
        """A published session (keys as bytes, token ids as a list), or None: missing, expired, or
        not signed by a trusted key."""
        blob = self.client.call(lambda client: client.get(entry_key(fingerprint, session_id)))
        return self._parse_entry(blob, full=True)

    def list_sessions(self, fingerprint: bytes, limit: int = 1000) -> list[dict]:
        """The sessions other boxes (and this one) published for this model, newest first, without
        their keys and token ids."""
        index = sessions_key(fingerprint)
        ids = self.client.call(lambda client: client.zrevrange(index, 0, limit - 1))
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i in ids]
        if not ids:
            return []

        def get_all(client):
            pipe = client.pipeline(transaction=False)
            for session_id in ids:
                pipe.get(entry_key(fingerprint, session_id))
            return pipe.execute()

        blobs = self.client.call(get_all)
        out, gone = [], []
        for session_id, blob in zip(ids, blobs):
            entry = self._parse_entry(blob, full=False)
            if entry is None or entry.get("session_id") != session_id:
                gone.append(session_id)
                continue
            out.append(entry)
        if gone:  # expired or evicted entries: tidy the index
            try:
                self.client.call(lambda client: client.zrem(index, *gone))
            except SharedUnavailable:
                pass
        return out

    def _parse_entry(self, blob: bytes | None, full: bool) -> dict | None:
        import orjson

        if not blob or not blob.startswith(ENTRY_MAGIC) or len(blob) < 4 + MAC_BYTES:
            return None
        mac, body = blob[4 : 4 + MAC_BYTES], blob[4 + MAC_BYTES :]
        if not self.signer.verified(body, mac):
            self.counters["rejected_entries"] += 1
            return None
        try:
            entry = orjson.loads(body)
            key_len = int(entry.get("key_len") or 0)
            keys = base64.b64decode(entry["keys"])
            entry["blocks"] = len(keys) // key_len if key_len else 0
            if full:
                import numpy as np

                entry["keys"] = [keys[i : i + key_len] for i in range(0, len(keys), key_len)] if key_len else []
                entry["token_ids"] = np.frombuffer(base64.b64decode(entry["token_ids"]), dtype="<u4").tolist()
                entry["namespace"] = bytes.fromhex(entry["namespace"])
            else:
                del entry["keys"], entry["token_ids"]
            return entry
        except (ValueError, KeyError, TypeError):
            self.counters["rejected_entries"] += 1
            return None


def _tokens_bytes(token_ids) -> bytes:
    import numpy as np

    if token_ids is None:
        return b""
    return np.asarray(token_ids, dtype="<u4").tobytes()
