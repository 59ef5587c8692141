"""Warm tier: one host-memory arena of a fixed byte budget, cut into fixed-size slots.

Two halves, like the rest of kvtier:

* ``SlotAllocator`` (scheduler side, no memory): the free list. It hands out slot numbers and can
  never hand out more than ``capacity_bytes // slot_bytes`` of them, so the tier can never exceed
  its budget.
* ``DramArena`` (worker side): the single allocation behind the slots, page-aligned so direct IO
  can read and write slots in place, and pinned when CUDA is present so host<->device copies run
  asynchronously at full PCIe speed.

Pinning registers an anonymous mmap of exactly the budget with ``cudaHostRegister`` (as vLLM's
own offloading does), instead of ``torch.empty(pin_memory=True)``: PyTorch's caching host
allocator rounds every pinned request up to a power of two, so a 32 GiB budget would pin 64 GiB.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvtier.errors import CapacityError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["SlotAllocator", "DramArena", "PAGE", "round_up"]

log = logging.getLogger(__name__)

PAGE = 4096


def round_up(n: int, align: int = PAGE) -> int:
    return (n + align - 1) // align * align


def slot_size(nbytes: int) -> int:
    """Bytes one slot takes: page-aligned (O_DIRECT straight from the slot) unless that would waste
    more than 1/16 of a small slot, then 256-byte aligned (NVMe IO goes through a bounce buffer)."""
    paged = round_up(nbytes)
    return paged if paged - nbytes <= nbytes // 16 else round_up(nbytes, 256)


class SlotAllocator:
    """Free list of fixed-size slots inside a byte budget."""

    def __init__(self, capacity_bytes: int, slot_bytes: int):
        if slot_bytes <= 0:
            raise CapacityError(f"DRAM tier: slot size must be positive, got {slot_bytes}")
        self.slot_bytes = slot_size(slot_bytes)
        self.num_slots = max(0, capacity_bytes // self.slot_bytes)
        if self.num_slots == 0:
            raise CapacityError(
                f"DRAM tier: a budget of {capacity_bytes} bytes holds no {self.slot_bytes}-byte block",
                hint="raise --dram (it must hold at least one KV block)",
            )
        # A stack: the most recently freed slot is reused first (it is warm in the CPU caches).
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._used = bytearray(self.num_slots)
        self.freed: list[int] = []  # slots released since the last drain (the worker forgets them)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def used_bytes(self) -> int:
        return self.used_slots * self.slot_bytes

    def allocate(self) -> int | None:
        """A free slot number, or None when the tier is full (normal pressure, not an error)."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used[slot] = 1
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or not self._used[slot]:
            raise ValueError(f"DRAM slot {slot} is not allocated")
        self._used[slot] = 0
        self._free.append(slot)
        self.freed.append(slot)

    def drain_freed(self) -> list[int]:
        freed, self.freed = self.freed, []
        return freed


class DramArena:
    """The one host allocation behind the slots (pinned when CUDA is present)."""

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool | None = None):
        import torch

        self.slot_bytes = slot_size(slot_bytes)
        self.num_slots = num_slots
        if pin is None:
            pin = torch.cuda.is_available()
        size = num_slots * self.slot_bytes
        self.buffer, self.pinned = host_buffer(size, pin)  # page-aligned: O_DIRECT reads/writes slots in place

    @classmethod
    def for_allocator(cls, allocator: SlotAllocator, pin: bool | None = None) -> "DramArena":
        return cls(allocator.num_slots, allocator.slot_bytes, pin)

    def slot(self, slot: int, nbytes: int | None = None) -> "torch.Tensor":
        """The uint8 view of one slot (its first ``nbytes`` bytes if given)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"DRAM slot {slot} out of range 0..{self.num_slots - 1}")
        if nbytes is not None and nbytes > self.slot_bytes:  # would reach into the next slot
            raise CapacityError(f"DRAM tier: {nbytes} bytes do not fit a {self.slot_bytes}-byte slot")
        start = slot * self.slot_bytes
        return self.buffer[start : start + (self.slot_bytes if nbytes is None else nbytes)]

    def put(self, slot: int, src: "torch.Tensor") -> int:
        """Copy ``src`` (any dtype, contiguous) into a slot; returns the bytes written."""
        flat = _as_bytes(src)
        if flat.numel() > self.slot_bytes:
            raise CapacityError(f"DRAM tier: {flat.numel()} bytes do not fit a {self.slot_bytes}-byte slot")
        self.slot(slot, flat.numel()).copy_(flat, non_blocking=True)
        return flat.numel()

    def get(self, slot: int, dst: "torch.Tensor") -> int:
        """Copy a slot's first ``dst.nbytes`` bytes into ``dst``; returns the bytes read."""
        flat = _as_bytes(dst)
        flat.copy_(self.slot(slot, flat.numel()), non_blocking=True)
        return flat.numel()


def _as_bytes(t: "torch.Tensor") -> "torch.Tensor":
    import torch

    if not t.is_contiguous():
        raise ValueError("DRAM tier: tensors must be contiguous")
    return t.reshape(-1).view(torch.uint8)


def aligned_empty(nbytes: int, pin: bool = False) -> "torch.Tensor":
    """A page-aligned uint8 buffer of ``nbytes`` (rounded up to a page), so O_DIRECT reads land in
    it without a bounce copy; pinned (registered) when ``pin`` and CUDA allow it."""
    return host_buffer(round_up(nbytes), pin)[0]


class _Mapping:
    """Owns one anonymous mmap and its CUDA registration; both end when the last view is gone."""

    def __init__(self, size: int):
        import mmap

        self.map = mmap.mmap(-1, max(size, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if size >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):  # fewer pages to pin per O_DIRECT read
            try:
                self.map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # transparent huge pages off: 4 KiB pages, as before
                pass
        self.registered = 0  # the registered address (0: not pinned)

    def __del__(self) -> None:
        if self.registered:
            _cudart_call("cudaHostUnregister", self.registered)


def _cudart_call(name: str, *args) -> int:
    """A CUDA runtime call through PyTorch's bindings; its error code (0: success)."""
    import torch

    result = getattr(torch.cuda.cudart(), name)(*args)
    return int(getattr(result, "value", result) or 0)


def host_buffer(size: int, pin: bool) -> tuple["torch.Tensor", bool]:
    """``size`` bytes of page-aligned host memory as a uint8 tensor, and whether it is pinned.

    The memory is an anonymous mmap (page-aligned, exactly ``size`` rounded to a page), registered
    with ``cudaHostRegister`` when ``pin``: no power-of-two rounding, and pages are committed as
    they are touched until then. A failed registration (memlock limits, no driver) falls back to
    pageable memory and says so."""
    import torch

    mapping = _Mapping(round_up(size))
    tensor = torch.frombuffer(mapping.map, dtype=torch.uint8)[:size]
    tensor._kvtier_mapping = mapping  # keeps the mmap (and its registration) alive with the tensor
    if pin and torch.cuda.is_available() and size:
        code = _cudart_call("cudaHostRegister", tensor.data_ptr(), round_up(size), 0)
        if code == 0:
            mapping.registered = tensor.data_ptr()
        else:
            log.warning("DRAM tier: cudaHostRegister of %d bytes failed (error %d); using pageable memory",
                        size, code)
    return tensor, bool(mapping.registered)
