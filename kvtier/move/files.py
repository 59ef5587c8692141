"""Snapshot files for the ``Mover``: a session written to its snapshot file (this rank's shard,
signed), a snapshot restored into DRAM or NVMe.

Owns nothing but its collaborators: the arena and slot ledger (the DRAM side), the disk handler
(the NVMe side: its store, its counted group commits and the disk's health), the store fences and
the link counters.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvtier.codecs import get_codec, transcode
from kvtier.errors import KvtierError
from kvtier.jobs import Job, JobResult
from kvtier.move.disk import DiskMoves
from kvtier.move.fences import SlotFences
from kvtier.move.ledger import SlotLedger
from kvtier.move.links import LinkBytes
from kvtier.move.recode import note, transcoded

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.layout import ModelFingerprint
    from kvtier.tiers.dram import DramArena

__all__ = ["SnapshotFiles"]

log = logging.getLogger("kvtier.move.mover")

RESTORE_BATCH_BYTES = 32 << 20  # a restore's blocks bound for NVMe, per group commit


def signing_key_or_none() -> bytes | None:
    """This box's snapshot key (``kvtier.persist.trust``), made on first use; None if it cannot be had
    (the snapshot is then written unsigned, and restores only with --trust-unsigned)."""
    from kvtier.errors import KvtierError
    from kvtier.persist.trust import signing_key

    try:
        return signing_key()
    except (KvtierError, OSError) as exc:
        log.warning("kvtier: snapshot written unsigned: %s", exc)
        return None


class SnapshotFiles:
    def __init__(self, fingerprint: "ModelFingerprint", arena: "DramArena", ledger: SlotLedger, disk: DiskMoves,
                 fences: SlotFences, links: LinkBytes, rank: int = 0, shards: int = 1):
        self.fingerprint, self.arena, self.ledger, self.disk = fingerprint, arena, ledger, disk
        self.fences, self.links = fences, links
        self.rank, self.shards = rank, shards  # tensor parallelism: this rank's shard of every file

    # ---- snapshots ----------------------------------------------------------------------------
    def snapshot(self, job: Job, result: JobResult) -> None:
        """Write this rank's shard of a session to its snapshot file (``shard_path``)."""
        import torch

        from kvtier.persist.snapshot import shard_path, write_snapshot

        header = job.header or {}
        self.fences.wait([m.dram_slot for m in job.moves if not m.from_nvme])
        bounce = torch.empty(max([self.arena.slot_bytes] + [m.nbytes for m in job.moves]), dtype=torch.uint8)
        sizes = self.sizes(job)  # as written, after re-encoding: this rank's own

        def payloads():
            for i, move in enumerate(job.moves):
                if move.from_nvme:
                    nbytes, move.codec = self.disk.need_store().read_into(move.namespace, move.key, bounce,
                                                                            self.fingerprint.digest)
                    payload = bounce[:nbytes]
                else:
                    payload = self.arena.slot(move.dram_slot, self.ledger.nbytes_of(move))
                if move.to_codec and move.codec != move.to_codec:
                    payload = transcoded(move, payload, self.fingerprint.geometry)
                if sizes is not None and len(payload) != sizes[i]:
                    raise KvtierError(f"snapshot: block {i} holds {len(payload)} bytes, planned {sizes[i]}")
                yield payload
                self.links.count("tier->snapshot", len(payload), result)

        blocks = payloads()
        if sizes is None:  # a data-dependent codec on a sharded engine: encode first to learn the sizes
            listed = [bytes(p.numpy()) for p in blocks]
            sizes, blocks = [len(p) for p in listed], iter(listed)
        info = write_snapshot(
            shard_path(job.path, self.rank, self.shards), self.fingerprint, header["session_id"],
            header["namespace"], codec=header.get("codec", job.moves[0].codec),
            num_tokens=header["num_tokens"], keys=[m.key for m in job.moves], payloads=blocks,
            block_nbytes=sizes, token_ids=header.get("token_ids") or (),
            meta={"key_scheme": header["key_scheme"]} if header.get("key_scheme") else None,
            sign_key=signing_key_or_none(), in_place=bool(header.get("in_place")),
        )
        result.path = str(info.path)

    def sizes(self, job: Job) -> list[int] | None:
        """Each block's size in this rank's snapshot file, known before writing it (None when a
        data-dependent codec makes that impossible without encoding first)."""
        planned = (job.header or {}).get("sizes")
        if self.shards <= 1 and planned:
            return list(planned)
        sizes = []
        for move in job.moves:
            if move.to_codec and move.codec != move.to_codec:
                n = get_codec(move.to_codec).nbytes_for(self.fingerprint.geometry, move.first)
            elif move.from_nvme:
                n = self.disk.need_store().size_of(move.namespace, move.key)
            else:
                n = self.ledger.nbytes_of(move)
            if n is None:
                return None
            sizes.append(int(n))
        return sizes

    def restore(self, job: Job, result: JobResult) -> None:
        import numpy as np

        from kvtier.persist.snapshot import read_blocks, shard_path

        wanted = {m.position: i for i, m in enumerate(job.moves)}  # snapshot position -> move
        pending: list[tuple[int, bytearray]] = []  # blocks bound for NVMe, written in group commits
        written: list[int] = []
        outcomes: list = []

        def flush() -> None:
            if pending:
                store = self.disk.need_store()
                outcomes.extend(store.write_batch([(job.moves[i].namespace, job.moves[i].key, data,
                                                    job.moves[i].codec) for i, data in pending],
                                                  self.fingerprint.digest))
                written.extend(i for i, _ in pending)
                pending.clear()

        shard = shard_path(job.path, self.rank, self.shards)
        if (job.header or {}).get("require_signed"):
            from kvtier.errors import SnapshotError
            from kvtier.persist.snapshot import open_snapshot
            from kvtier.persist.trust import load_keys

            if not open_snapshot(shard, trusted_keys=load_keys()).signed:
                raise SnapshotError(f"snapshot shard {shard} (rank {self.rank}) is not signed by a key this "
                                    "server trusts", hint="restore it with --trust-unsigned if you trust it",
                                    path=str(shard))
        for position, payload in read_blocks(shard, expected_fingerprint=self.fingerprint):
            i = wanted.get(position)
            if i is None:
                continue
            move = job.moves[i]
            if move.to_nvme:  # the reader reuses its buffer: keep a copy for the batch
                pending.append((i, bytearray(payload)))
                if sum(len(data) for _, data in pending) >= RESTORE_BATCH_BYTES:
                    flush()
            elif move.to_codec and move.to_codec != move.codec:  # too big for a warm slot: re-encode
                import torch

                move.nbytes = transcode(torch.frombuffer(payload, dtype=torch.uint8), move.codec, move.to_codec,
                                        self.fingerprint.geometry, self.arena.slot(move.dram_slot), first=move.first)
                move.codec = move.to_codec
                note(result, i, move)
                self.ledger.own(move)
                self.links.count("snapshot->dram", len(payload), result)
            else:
                self.arena.slot(move.dram_slot, len(payload)).numpy()[:] = np.frombuffer(payload, np.uint8)
                self.ledger.own(move)
                self.links.count("snapshot->dram", len(payload), result)
        flush()
        self.disk.collect_writes(outcomes, [job.moves[i] for i in written], result, "snapshot->nvme")
        result.failed = [written[k] for k in result.failed]
