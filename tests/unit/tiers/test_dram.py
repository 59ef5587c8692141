"""Tests for kvtier.tiers.dram: the slot allocator (budget) and the page-aligned arena."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.errors import CapacityError
from kvtier.tiers.dram import PAGE, DramArena, SlotAllocator, round_up, slot_size

KiB = 1024


# ---- SlotAllocator ----------------------------------------------------------------------------
def test_round_up():
    assert [round_up(n) for n in (0, 1, 4095, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]
    assert round_up(5, 8) == 8
    assert slot_size(2 << 20) == 2 << 20 and slot_size((1 << 20) + 1) == (1 << 20) + PAGE
    assert slot_size(4097) == 4352  # a page would waste ~50%: 256-byte aligned instead


@pytest.mark.parametrize("capacity,slot", [(10 * PAGE, PAGE), (10 * PAGE - 1, PAGE), (1 << 20, 5000),
                                           (3 * 8192 + 8191, 4097), (PAGE, 1)])
def test_allocate_until_full(capacity, slot):
    alloc = SlotAllocator(capacity, slot)
    # Slots are rounded up (to a page, or 256 bytes when a page would waste > 1/16 of a small
    # slot), so never more than capacity // slot_bytes of them.
    assert alloc.slot_bytes == slot_size(slot) >= slot
    assert alloc.num_slots == capacity // slot_size(slot) <= capacity // slot
    taken = []
    # Allocate until the tier says full (None, not an error); the budget holds at every step.
    while (s := alloc.allocate()) is not None:
        taken.append(s)
        assert alloc.used_bytes <= capacity
        assert alloc.used_bytes == len(taken) * alloc.slot_bytes
    assert sorted(taken) == list(range(alloc.num_slots))
    assert alloc.free_slots == 0 and alloc.used_slots == alloc.num_slots
    assert alloc.capacity_bytes <= capacity
    # Still full on a second ask; freeing one makes exactly that one available again.
    assert alloc.allocate() is None
    alloc.free(taken[0])
    assert alloc.allocate() == taken[0]
    assert alloc.allocate() is None


def test_double_free_and_foreign_slot_raise():
    alloc = SlotAllocator(4 * PAGE, PAGE)
    a = alloc.allocate()
    alloc.free(a)
    # Freeing it again is a bookkeeping bug and must not put it twice on the free list.
    with pytest.raises(ValueError):
        alloc.free(a)
    # Never-allocated, negative and out-of-range slots are refused.
    for foreign in (3, -1, 4, 10**6):
        with pytest.raises(ValueError):
            alloc.free(foreign)
    # The failed frees changed nothing: still exactly 4 distinct slots.
    got = [alloc.allocate() for _ in range(5)]
    assert got[4] is None and sorted(got[:4]) == [0, 1, 2, 3]


@pytest.mark.parametrize("capacity,slot", [(0, PAGE), (PAGE - 1, PAGE), (5000, 5000), (8191, 8000),
                                           (-1, PAGE), (-(10 * PAGE), PAGE)])
def test_budget_smaller_than_one_block_raises(capacity, slot):
    with pytest.raises(CapacityError) as info:
        SlotAllocator(capacity, slot)
    assert info.value.hint and "--dram" in info.value.hint


@pytest.mark.parametrize("slot", [0, -1])
def test_bad_slot_size_raises(slot):
    with pytest.raises(CapacityError):
        SlotAllocator(1 << 20, slot)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity=st.integers(min_value=PAGE, max_value=64 * PAGE),
    slot=st.integers(min_value=1, max_value=6 * PAGE),
    ops=st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=10**6)), max_size=200),
)
def test_allocator_property(capacity, slot, ops):
    if capacity < slot_size(slot):
        with pytest.raises(CapacityError):
            SlotAllocator(capacity, slot)
        return
    alloc = SlotAllocator(capacity, slot)
    limit = capacity // slot
    held: set[int] = set()
    for is_alloc, pick in ops:
        if is_alloc or not held:
            s = alloc.allocate()
            if s is None:
                # None only when really full.
                assert len(held) == alloc.num_slots
            else:
                assert s not in held and 0 <= s < alloc.num_slots
                held.add(s)
        else:
            victim = sorted(held)[pick % len(held)]
            alloc.free(victim)
            held.remove(victim)
            with pytest.raises(ValueError):
                alloc.free(victim)
        # The invariants, after every operation.
        assert len(held) <= limit
        assert alloc.used_slots == len(held)
        assert alloc.used_bytes == len(held) * alloc.slot_bytes <= capacity
        assert alloc.free_slots + alloc.used_slots == alloc.num_slots


# ---- DramArena --------------------------------------------------------------------------------
def test_arena_is_page_aligned_and_slots_do_not_overlap():
    alloc = SlotAllocator(7 * 65536, 65000)
    arena = DramArena.for_allocator(alloc, pin=False)
    assert arena.slot_bytes == 65536 and arena.num_slots == 7
    assert arena.buffer.data_ptr() % PAGE == 0
    assert arena.buffer.numel() == 7 * 65536 and arena.buffer.dtype == torch.uint8
    assert not arena.pinned
    # Every slot starts on a page and covers exactly its own byte range.
    spans = []
    for s in range(arena.num_slots):
        view = arena.slot(s)
        assert view.data_ptr() % PAGE == 0 and view.numel() == arena.slot_bytes
        spans.append((view.data_ptr(), view.data_ptr() + view.numel()))
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0
    # Fill each slot with its own number, then check no slot's write reached a neighbour.
    for s in range(arena.num_slots):
        arena.slot(s).fill_(s + 1)
    for s in range(arena.num_slots):
        assert torch.all(arena.slot(s) == s + 1)
    assert arena.slot(3, 100).numel() == 100
    for bad in (-1, 7):
        with pytest.raises(IndexError):
            arena.slot(bad)


def test_arena_put_get_round_trip_bf16():
    gen = torch.Generator().manual_seed(0)
    arena = DramArena(4, 3 * PAGE, pin=False)
    blocks = {s: torch.randn((2, 2, 16, 2, 8), generator=gen).to(torch.bfloat16) for s in range(4)}
    # Put a block into every slot (each 2 KiB: a partial slot).
    for s, block in blocks.items():
        assert arena.put(s, block) == block.numel() * 2
    # Overwrite slot 2 with another block; slots 1 and 3 stay intact.
    blocks[2] = torch.randn((2, 2, 16, 2, 8), generator=gen).to(torch.bfloat16)
    arena.put(2, blocks[2])
    for s, block in blocks.items():
        back = torch.empty_like(block)
        assert arena.get(s, back) == block.numel() * 2
        assert torch.equal(back.view(torch.int16), block.view(torch.int16))
    # A full-slot payload fits exactly.
    full = torch.arange(3 * PAGE // 2, dtype=torch.int16).view(torch.bfloat16)
    assert arena.put(0, full) == 3 * PAGE
    back = torch.empty_like(full)
    arena.get(0, back)
    assert torch.equal(back.view(torch.int16), full.view(torch.int16))


def test_arena_oversize_and_noncontiguous_raise():
    arena = DramArena(3, PAGE, pin=False)
    arena.slot(1).fill_(0xAB)
    # One byte more than a slot must not spill into the next slot.
    with pytest.raises(CapacityError):
        arena.put(0, torch.zeros(PAGE + 1, dtype=torch.uint8))
    with pytest.raises(CapacityError):
        arena.put(0, torch.zeros(PAGE // 2 + 1, dtype=torch.bfloat16))
    assert torch.all(arena.slot(1) == 0xAB)
    # Reading more than a slot must not return the neighbour's bytes either.
    with pytest.raises(CapacityError):
        arena.get(0, torch.empty(PAGE + 1, dtype=torch.uint8))
    with pytest.raises(CapacityError):
        arena.slot(0, PAGE + 1)
    with pytest.raises(ValueError):
        arena.put(0, torch.zeros(8, 8, dtype=torch.bfloat16).t())
