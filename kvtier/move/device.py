"""HBM <-> DRAM for the ``Mover``: stores gather blocks out of vLLM's per-layer KV tensors (through
a layout adapter) into their DRAM slots, encoding them on the way; loads decode them back and
scatter them into HBM, reading the NVMe blocks first through the disk handler. With CUDA the
copies run on the copy stream through pinned DRAM slots.

Owns the KV tensors and their layout adapter; the device and stream are the ``CopyStream``'s.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from kvtier.codecs import get_codec
from kvtier.jobs import BlockMove, Job, JobResult
from kvtier.move.disk import DiskMoves
from kvtier.move.fences import SlotFences
from kvtier.move.ledger import SlotLedger
from kvtier.move.links import LinkBytes
from kvtier.move.recode import note
from kvtier.move.staging import StagingPool
from kvtier.move.stream import CopyStream

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.layout import LayoutAdapter, ModelFingerprint
    from kvtier.tiers.dram import DramArena

__all__ = ["DeviceCopies", "PIPELINE_BYTES"]

# a load reads its NVMe blocks in parts of about this size and copies each part to the device as
# soon as it has landed: with CUDA the copy of the first part runs on the copy stream while the next
# is read (a 15 GB session then costs the larger of its read and its host-to-device copy, not both)
PIPELINE_BYTES = 256 << 20


class DeviceCopies:
    def __init__(self, fingerprint: "ModelFingerprint", arena: "DramArena", adapter: "LayoutAdapter | None",
                 kv_layers: "Sequence[torch.Tensor] | None", stream: CopyStream, ledger: SlotLedger,
                 links: LinkBytes, fences: SlotFences, disk: DiskMoves, staging: StagingPool):
        self.fingerprint, self.arena, self.stream = fingerprint, arena, stream
        self.adapter = adapter
        self.kv_layers = list(kv_layers) if kv_layers is not None else None
        self.ledger, self.links, self.fences, self.disk, self.staging = ledger, links, fences, disk, staging

    @property
    def device(self) -> "torch.device":
        return self.stream.device

    def _staging(self, n: int) -> "torch.Tensor":
        import torch

        dtype = getattr(torch, self.fingerprint.geometry.dtype)
        return torch.empty((n, *self.fingerprint.geometry.block_shape), dtype=dtype, device=self.device)

    def _as_block(self, raw: "torch.Tensor") -> "torch.Tensor":
        """A uint8 buffer holding one block, viewed as ``[1, *block_shape]`` in the KV dtype."""
        import torch

        geometry = self.fingerprint.geometry
        return raw[: geometry.block_bytes].view(getattr(torch, geometry.dtype)).view(1, *geometry.block_shape)

    def store(self, job: Job, result: JobResult) -> None:
        assert self.adapter is not None and self.kv_layers is not None, "mover has no KV tensors"
        plain = all(get_codec(m.codec).raw for m in job.moves)
        if not self.stream.cuda and plain:  # CPU: gather each block straight into its DRAM slot
            for move in job.moves:
                self.adapter.gather(self.kv_layers, [move.device_block],
                                    self._as_block(self.arena.slot(move.dram_slot)))
                self.ledger.own(move)
                self.links.count("hbm->dram", move.nbytes, result)
            return
        staging = self._staging(len(job.moves))  # one gather, then per block: encode (and D2H)
        with self.stream.on_stream():
            self.adapter.gather(self.kv_layers, [m.device_block for m in job.moves], staging)
            for i, move in enumerate(job.moves):
                codec = get_codec(move.codec)
                if self.stream.cuda and plain:
                    move.nbytes = self.arena.put(move.dram_slot, staging[i])
                elif not self.stream.cuda or codec.host_unpack:
                    move.nbytes = codec.encode(staging[i], self.arena.slot(move.dram_slot), first=move.first)
                else:  # CUDA: encode on the device, then copy the smaller payload to the pinned slot
                    import torch

                    scratch = torch.empty(codec.max_bytes(self.fingerprint.geometry), dtype=torch.uint8,
                                          device=self.device)
                    move.nbytes = codec.encode(staging[i], scratch, first=move.first)
                    self.arena.slot(move.dram_slot, move.nbytes).copy_(scratch[: move.nbytes], non_blocking=True)
                note(result, i, move)
                self.ledger.own(move)
                self.links.count("hbm->dram", move.nbytes, result)
            self.stream.sync()

    def load(self, job: Job, result: JobResult) -> None:
        """Read and copy in parts (``PIPELINE_BYTES``), in the job's order (a session's prefix
        first); only the prefix before the first bad block is loaded, vLLM recomputes the rest."""
        assert self.adapter is not None and self.kv_layers is not None, "mover has no KV tensors"
        self.fences.wait([m.dram_slot for m in job.moves if m.dram_slot >= 0 and not m.from_nvme])
        sources: dict = {}
        in_flight: list = []  # staging tensors the copy stream may still write: alive until the sync
        try:
            for part in _parts(job.moves, PIPELINE_BYTES):
                sources.update(self.disk.read(job, result, part))
                bad = min(result.failed, default=None)
                in_flight.append(self._load_sources(job, result, sources,
                                                    range(part.start, part.stop if bad is None else bad)))
                if bad is not None:
                    result.failed = list(range(bad, len(job.moves)))
                    break
        finally:
            self.stream.sync()  # every part's copies done before their buffers are reused
            self.staging.give(sources.values())

    def _load_sources(self, job: Job, result: JobResult, sources: dict, part: range) -> "torch.Tensor | None":
        """Copy ``part`` of the job's blocks (read already) into vLLM's KV cache; with CUDA the
        copies are queued on the copy stream, synchronised once the whole job is queued."""
        moves = job.moves[part.start : part.stop]
        for move in moves:
            if not move.from_nvme:
                move.nbytes = self.ledger.nbytes_of(move)
        raw = [sources.get(i, self.arena.slot(m.dram_slot) if m.dram_slot >= 0 else None)
               for i, m in zip(part, moves)]
        plain = all(get_codec(m.codec).raw for m in moves)
        if not self.stream.cuda and plain:  # CPU: scatter each block straight from its slot or read buffer
            for move, source in zip(moves, raw):
                self.adapter.scatter(self._as_block(source), self.kv_layers, [move.device_block])
                self.links.count("dram->hbm", move.nbytes, result)
            return None
        if not moves:
            return None
        staging = self._staging(len(moves))  # decode (on the device with CUDA) into staging, one scatter
        with self.stream.on_stream():
            for i, (move, source) in enumerate(zip(moves, raw)):
                self._decode_into(move, source[: move.nbytes], staging[i])
                self.links.count("dram->hbm", move.nbytes, result)
            self.adapter.scatter(staging, self.kv_layers, [m.device_block for m in moves])
        return staging

    def _decode_into(self, move: BlockMove, payload: "torch.Tensor", block: "torch.Tensor") -> None:
        """Decode one stored payload into a staging block (CUDA: H2D the payload, decode on the GPU)."""
        codec = get_codec(move.codec)
        if not self.stream.cuda:
            codec.decode(payload, block)
            return
        if codec.raw:
            block.view(-1).view(payload.dtype).copy_(payload, non_blocking=True)
            return
        if codec.host_unpack:  # the lossless layer unpacks on the CPU
            payload, codec = codec.unpack(payload, codec.inner.max_bytes(self.fingerprint.geometry)), codec.inner
        codec.decode(payload.to(self.device, non_blocking=True), block)


def _parts(moves: Sequence[BlockMove], part_bytes: int) -> list[range]:
    """Consecutive ranges of ``moves`` holding about ``part_bytes`` of NVMe reads each (a range ends
    after the move that reaches it; DRAM blocks ride along with their neighbours)."""
    parts, start, size = [], 0, 0
    for i, move in enumerate(moves):
        if move.from_nvme:
            size += max(move.nbytes, 1)
        if size >= part_bytes:
            parts.append(range(start, i + 1))
            start, size = i + 1, 0
    if start < len(moves) or not parts:
        parts.append(range(start, len(moves)))
    return parts
