"""``python -m benchmarks shared``, the parts without vLLM: the shared tier against its own client, and
forged or damaged values written into the store.

* ``shared_put_vs_client_raw`` / ``shared_get_vs_client_raw``: the tier's ``write_batch`` /
  ``read_batch`` (header, signature, checksum, one pipeline per 8 MiB) against the same redis-py
  client's plain pipelined SET / GET of the same payload bytes, same server, same run, rounds
  interleaved; the worse of 2 MiB and 256 KiB blocks.
* ``foreign_values_served``: values written under the keys the tier reads -- random bytes,
  truncated, a flipped payload or header byte, another block's value, another namespace, model or
  rank, a header whose length lies, an unsigned one and one signed with an unknown key (both with
  valid checksums) -- read through the tier and through a FETCH job of a real engine; every value
  that came back as a block counts.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable

__all__ = ["run_client_ratios", "run_foreign_values", "FORGERIES"]

BATCH_BYTES = 8 << 20
FORGERIES = ("random", "truncated", "payload_flip", "header_flip", "other_key", "other_namespace",
             "other_model", "other_rank", "length_lie", "unsigned", "unknown_key", "empty")


def _median_seconds(fn: Callable[[], None], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_client_ratios(url: str, sizes=(2 << 20, 256 << 10), total_bytes: int = 64 << 20, rounds: int = 7,
                      progress: Callable[[str], None] = print) -> dict:
    import redis
    import torch

    from kvtier.tiers.shared.store import SharedConfig, SharedStore

    store = SharedStore(SharedConfig(url))
    client = redis.Redis.from_url(url, socket_timeout=10)
    results: dict = {}
    fingerprint, namespace = os.urandom(16), os.urandom(16)
    try:
        for size in sizes:
            count = max(8, total_bytes // size)
            payloads = [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(count)]
            raw_bytes = [bytes(p.numpy()) for p in payloads]
            keys = [os.urandom(32) for _ in range(count)]
            per = max(1, BATCH_BYTES // size)
            batches = [range(i, min(i + per, count)) for i in range(0, count, per)]
            raw_names = [b"kvt1:bench:raw:%d" % i for i in range(count)]
            dests = [torch.empty(size, dtype=torch.uint8) for _ in range(count)]

            def plain_put(through) -> Callable[[], None]:
                def put() -> None:
                    for batch in batches:
                        pipe = through.pipeline(transaction=False)
                        for i in batch:
                            pipe.set(raw_names[i], raw_bytes[i], ex=600)
                        pipe.execute()
                return put

            raw_put = plain_put(client)
            packed_put = plain_put(store.client.call(lambda c: c))  # the tier's own client (its zero-copy packer)

            def tier_put() -> None:
                for batch in batches:
                    outcomes = store.write_batch([(namespace, keys[i], payloads[i], "none") for i in batch],
                                                 fingerprint)
                    assert all(o is None for o in outcomes), outcomes

            def raw_get() -> None:
                for batch in batches:
                    pipe = client.pipeline(transaction=False)
                    for i in batch:
                        pipe.get(raw_names[i])
                    values = pipe.execute()
                    assert all(v is not None for v in values)

            def tier_get() -> None:
                for batch in batches:
                    outcomes = store.read_batch([(namespace, keys[i], dests[i]) for i in batch], fingerprint)
                    assert all(isinstance(o, tuple) for o in outcomes), outcomes

            raw_put(), tier_put(), raw_get(), tier_get()  # warm-up: connections, allocator, keys
            put_raw, put_tier, get_raw, get_tier, put_packed = [], [], [], [], []
            for _ in range(rounds):  # interleaved, so drift hits both alike
                put_packed.append(_median_seconds(packed_put, 1))
                put_raw.append(_median_seconds(raw_put, 1))
                put_tier.append(_median_seconds(tier_put, 1))
                get_raw.append(_median_seconds(raw_get, 1))
                get_tier.append(_median_seconds(tier_get, 1))
            assert all(bytes(d.numpy()) == r for d, r in zip(dests, raw_bytes))
            label = f"{size >> 20}MiB" if size >= 1 << 20 else f"{size >> 10}KiB"
            put = statistics.median(put_raw) / statistics.median(put_tier)
            get = statistics.median(get_raw) / statistics.median(get_tier)
            moved = count * size
            results[f"_put_vs_raw_{label}"] = put
            results[f"_put_vs_same_packer_{label}"] = statistics.median(put_packed) / statistics.median(put_tier)
            results[f"_get_vs_raw_{label}"] = get
            results[f"_raw_put_gbps_{label}"] = moved / statistics.median(put_raw) / 1e9
            results[f"_raw_get_gbps_{label}"] = moved / statistics.median(get_raw) / 1e9
            progress(f"{label} blocks: put {put:.3f}x raw, get {get:.3f}x raw")
            client.delete(*raw_names)
        results["shared_put_vs_client_raw"] = min(v for k, v in results.items() if k.startswith("_put_vs_raw"))
        results["shared_get_vs_client_raw"] = min(v for k, v in results.items() if k.startswith("_get_vs_raw"))
    finally:
        store.close()
        client.close()
    return results


def forge(kind: str, good: bytes, other_key_value: bytes, store, namespace: bytes, key: bytes,
          fingerprint: bytes, payload: bytes) -> bytes:
    """A value for ``key`` that the tier must refuse, made the ``kind`` way from ``good`` (a valid one)."""
    from kvtier.tiers.records import checksum, pack_header
    from kvtier.tiers.shared.store import VALUE_PREFIX

    def signed_with(mac_key: bytes | None, **override) -> bytes:
        from kvtier.persist.trust import sign

        fields = dict(namespace=namespace, key=key, fingerprint=fingerprint, rank=0, nbytes=len(payload))
        fields.update(override)
        header = bytearray(VALUE_PREFIX - 16)
        pack_header(header, fields["nbytes"], checksum(payload), fields["fingerprint"], fields["namespace"],
                    "none", fields["key"], fields["rank"])
        mac = sign(mac_key, bytes(header)) if mac_key else bytes(16)
        return bytes(header) + mac + payload

    own = store.signer.signing_key()
    if kind == "random":
        return os.urandom(len(good))
    if kind == "truncated":
        return good[: len(good) // 2]
    if kind == "payload_flip":
        data = bytearray(good)
        data[VALUE_PREFIX + len(payload) // 3] ^= 0x10
        return bytes(data)
    if kind == "header_flip":
        data = bytearray(good)
        data[40] ^= 0x01
        return bytes(data)
    if kind == "other_key":
        return other_key_value
    if kind == "other_namespace":
        return signed_with(own, namespace=os.urandom(16))
    if kind == "other_model":
        return signed_with(own, fingerprint=os.urandom(16))
    if kind == "other_rank":
        return signed_with(own, rank=1)
    if kind == "length_lie":
        return signed_with(own, nbytes=len(payload) + 4096)
    if kind == "unsigned":
        return signed_with(None)
    if kind == "unknown_key":
        return signed_with(os.urandom(32))
    if kind == "empty":
        return b""
    raise ValueError(kind)


def run_foreign_values(url: str, per_kind: int = 45, progress: Callable[[str], None] = print) -> dict:
    """Forged and damaged values read through the tier (``read_batch``) and through a real engine's
    FETCH jobs; counts what was served."""
    import redis
    import torch

    from kvtier.engine import TierEngine
    from kvtier.layout import CpuLayout, KVGeometry, ModelFingerprint
    from kvtier.plan.index import chain_block_hashes, namespace_of
    from kvtier.tiers.shared.store import SharedConfig, SharedStore, block_key

    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16, dtype="bfloat16")
    fingerprint = ModelFingerprint("bench-shared", geometry)
    namespace = namespace_of(fingerprint.digest)
    client = redis.Redis.from_url(url, socket_timeout=10)
    store = SharedStore(SharedConfig(url))
    served = tried = 0

    def write_forged(keys: list[bytes], kind_of: Callable[[int], str]) -> None:
        """Under each key, a value forged the ``kind_of(position)`` way from a valid one."""
        pipe = client.pipeline(transaction=False)
        for i, key in enumerate(keys):
            payload = os.urandom(geometry.block_bytes)
            value = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            good, other = (store.signer.encode_value(namespace, name, value, "none", fingerprint.digest)
                           for name in (key, os.urandom(32)))
            pipe.set(block_key(namespace, key), forge(kind_of(i), good, other, store, namespace, key,
                                                     fingerprint.digest, payload), ex=600)
        pipe.execute()

    layers = [torch.zeros(CpuLayout(geometry).layer_shape(64), dtype=torch.bfloat16) for _ in range(2)]
    engine = TierEngine(fingerprint, 256 * geometry.block_bytes, kv_layers=layers, catalog=False,
                        shared=SharedConfig(url, codec="none"))
    try:
        for round_, kind in enumerate(FORGERIES):
            tokens = list(range(round_ * 100_000, round_ * 100_000 + per_kind * geometry.block_tokens))
            keys = chain_block_hashes(tokens, geometry.block_tokens)
            write_forged(keys, lambda _i, kind=kind: kind)
            # through the tier's own reads (each refused value is deleted from the store)
            dests = [torch.empty(geometry.block_bytes, dtype=torch.uint8) for _ in keys]
            outcomes = store.read_batch([(namespace, key, d) for key, d in zip(keys, dests)], fingerprint.digest)
            served += sum(1 for o in outcomes if isinstance(o, tuple))
            tried += len(keys)
            progress(f"{kind}: {sum(1 for o in outcomes if isinstance(o, tuple))} of {len(keys)} served")
        # and through an engine's fetch path: forged values under a prefix a request would ask for
        # (empty, truncated and random values a lookup would not even find: signed by a stranger instead)
        tokens = list(range(9_000_000, 9_000_000 + 64 * geometry.block_tokens))
        keys = chain_block_hashes(tokens, geometry.block_tokens)
        write_forged(keys, lambda i: kind if (kind := FORGERIES[i % len(FORGERIES)]) not in
                     ("empty", "truncated", "random") else "unknown_key")
        fetched = engine.fetch(namespace, keys)  # one lookup finds them all, one FETCH job reads them
        served += fetched
        tried += len(keys)
        progress(f"engine fetches of forged blocks: {fetched} of {len(keys)} served")
    finally:
        engine.close(write_back=False)
        store.close()
        client.close()
    return {"foreign_values_served": served, "_foreign_values_tried": tried}
