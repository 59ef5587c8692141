"""The budgets of ``kvtier serve``: sized to the box when they are automatic, and what other live
instances on the box have promised.

Automatic budgets (no ``--dram`` / ``--nvme``, or ``auto``): no fixed default fits every box, nor a
second server on the same disk, so each is a share of what is left once the other live instances'
budgets are counted -- the NVMe budget half of its disk's free space (per drive), the DRAM budget a
quarter of the available RAM -- capped at the built-in defaults (64 GiB, 4 GiB: a big box gets what
it got before), and refused below a floor where the tier would be useless.  :func:`auto_nvme_bytes`
and :func:`auto_dram_bytes` are the arithmetic, on numbers; :func:`size_budgets` measures the box and
calls them.  The other instances' promises come from their registry records, which hold budgets in
bytes (automatic ones as sized), never the word "auto".
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvtier.config import Settings, auto_budgets
from kvtier.errors import ConfigError
from kvtier.tiers.nvme.drives import nearest_existing
from kvtier.units import human_bytes

__all__ = ["Budgets", "DriveRoom", "INSTANCES_SUBDIR", "auto_dram_bytes", "auto_nvme_bytes", "check_dram",
           "committed_elsewhere", "dram_fits", "size_budgets", "stored_bytes"]

INSTANCES_SUBDIR = "instances"  # named instances' cold tiers, inside a shared --nvme-dir
MiB, GiB = 2**20, 2**30
NVME_AUTO_SHARE = 2  # an automatic NVMe budget: 1/2 of the room left on the disk (two racing starts still fit)
DRAM_AUTO_SHARE = 4  # an automatic DRAM budget: 1/4 of the RAM left (vLLM, its weights and the OS need the rest)
NVME_AUTO_FLOOR = GiB  # below this a cold tier holds too little to be worth a disk (four 256 MiB segments)
DRAM_AUTO_FLOOR = 256 * MiB  # below this a warm tier holds a handful of blocks of a small model
_SHARE_WORDS = {2: "½", 4: "¼"}


def stored_bytes(nvme_dir: Path) -> int:
    """Bytes kvtier's segments (and old-layout block files) already take on disk under ``nvme_dir``,
    every rank's included (reusable by the new budget)."""
    total = 0
    for root, dirs, files in os.walk(nvme_dir):
        if root == str(nvme_dir):  # named instances' stores are theirs, not this one's
            dirs[:] = [d for d in dirs if d != INSTANCES_SUBDIR]
        for name in files:
            if name.endswith((".kvseg", ".kvb")):
                try:
                    total += os.stat(os.path.join(root, name)).st_blocks * 512
                except OSError:  # removed meanwhile: nothing to count
                    continue
    return total


def committed_elsewhere(nvme_dir: Path, running: Sequence) -> int:
    """NVMe budget other live instances have on the same filesystem and have not filled yet: room
    this server must not count on."""
    return _promises(nvme_dir, running)[0]


def _promises(nvme_dir: Path, running: Sequence) -> tuple[int, int]:
    """What :func:`committed_elsewhere` counts, and how many instances have a drive there.  The
    registry records hold budgets in bytes (automatic ones as sized), so this is plain arithmetic."""
    try:
        device = os.stat(nearest_existing(nvme_dir.absolute())).st_dev
    except OSError:
        return 0, 0
    from kvtier.tiers.nvme.drives import drive_dirs, split_budget

    total, instances = 0, 0
    for other in running:
        if not other.nvme_dir or not other.nvme_bytes:
            continue
        drives = drive_dirs(other.nvme_dir)  # its drives, each with its share of its budget
        there = False
        for drive, budget in zip(drives, split_budget(drives, int(other.nvme_bytes))):
            try:
                if os.stat(nearest_existing(Path(drive))).st_dev != device:
                    continue
            except OSError:
                continue
            total += max(0, budget - stored_bytes(Path(drive)))
            there = True
        instances += there
    return total, instances


@dataclass(frozen=True)
class DriveRoom:
    """One drive of the cold tier as an automatic NVMe budget sees it (bytes)."""

    path: str
    free: int  # free on its filesystem now
    weight: int = 1  # its share of a budget split across the drives (``split_budget``'s proportions)
    stored: int = 0  # kvtier's blocks already in this directory: this instance's to reuse, not extra room
    promised: int = 0  # what other live instances on the filesystem may still fill
    others: int = 0  # how many other live instances have a drive on the filesystem

    @property
    def room(self) -> int:
        return max(0, self.free - self.promised) + self.stored

    def describe(self) -> str:
        text = f"{human_bytes(self.free)} free on {self.path}"
        if self.stored:
            text += f" + {human_bytes(self.stored)} kvtier already stores there"
        if self.others:
            text += f", less {human_bytes(self.promised)} promised to {_instances(self.others)}"
        return text


def _instances(n: int) -> str:
    return f"{n} other instance" + ("s" if n != 1 else "")


def auto_nvme_bytes(drives: Sequence[DriveRoom], cap: int) -> tuple[int, str]:
    """An automatic NVMe budget and how it was chosen: the largest total whose share on every drive
    (the budget is split by ``weight``) is at most half that drive's room, capped at ``cap``.

    Half, not all: the disk is shared with everything else on it, and a second server started at
    the same moment (before either is registered) still fits.  Raises ConfigError, naming the drive
    that is short, when that total is below ``NVME_AUTO_FLOOR``."""
    whole = sum(d.weight for d in drives)
    fits = [d.room // NVME_AUTO_SHARE * whole // d.weight for d in drives]
    total = min(cap, *fits)
    if total < NVME_AUTO_FLOOR:
        short = drives[fits.index(min(fits))]
        raise ConfigError(
            f"{short.describe()}: less than kvtier needs for an automatic NVMe budget "
            f"(it takes {_SHARE_WORDS[NVME_AUTO_SHARE]} of the room, at least {human_bytes(NVME_AUTO_FLOOR)})",
            hint="free disk space there, or pass --nvme-dir on another drive (or --nvme SIZE to set the budget)")
    share = _SHARE_WORDS[NVME_AUTO_SHARE]
    if len(drives) == 1:
        how = f"auto: {share} of {drives[0].describe()}"
    else:
        how = f"auto: {share} of the room on each of {len(drives)} drives, split by size: " + \
              "; ".join(d.describe() for d in drives)
    return total, how + (f", capped at {human_bytes(cap)}" if total == cap else "")


def auto_dram_bytes(available: int, promised: int = 0, others: int = 0, cap: int = 4 * GiB) -> tuple[int, str]:
    """An automatic DRAM budget and how it was chosen: a quarter of the RAM available less what
    ``others`` live instances promised their DRAM tiers, capped at ``cap``.

    A quarter: vLLM's weights and (on CPU) its own KV cache, the OS and the page cache the NVMe tier
    reads through need the rest.  Other instances' budgets count in full -- a tier fills as it is
    used, and RAM available now says nothing of that -- even where they are already resident
    (pinned with CUDA) and so counted twice: the automatic budget errs small, never into swap.
    Raises ConfigError below ``DRAM_AUTO_FLOOR``."""
    left = max(0, available - promised)
    total = min(cap, left // DRAM_AUTO_SHARE)
    less = f", less {human_bytes(promised)} promised to {_instances(others)}" if others else ""
    if total < DRAM_AUTO_FLOOR:
        raise ConfigError(
            f"available RAM is {human_bytes(available)}{less}: less than kvtier needs for an automatic DRAM "
            f"budget (it takes {_SHARE_WORDS[DRAM_AUTO_SHARE]} of it, at least {human_bytes(DRAM_AUTO_FLOOR)})",
            hint="free memory (other programs, other kvtier instances), or pass --dram a size that leaves "
                 "room for vLLM")
    how = f"auto: {_SHARE_WORDS[DRAM_AUTO_SHARE]} of {human_bytes(available)} available{less}"
    return total, how + (f", capped at {human_bytes(cap)}" if total == cap else "")


@dataclass(frozen=True)
class Budgets:
    """Settings with both budgets in bytes, and the line ``kvtier serve`` prints about them."""

    settings: Settings
    line: str


def size_budgets(settings: Settings, sources: Mapping[str, str] | None = None,
                 running: Sequence | None = None) -> Budgets:
    """Size the automatic budgets (``sources`` marks them; None: every budget is as given) from this
    box's available RAM and its NVMe drives' free space, less what the ``running`` instances (default:
    the live ones) promised.  Their sizes go into the returned settings, so the registry records the
    bytes this server may fill -- the next server counts them -- never the word "auto"."""
    from kvtier.tiers.nvme.drives import drive_dirs

    auto = auto_budgets(sources) if sources is not None else frozenset()
    if running is None:
        from kvtier.control.instances import list_instances

        running = list_instances()
    caps = {name: field.default for name, field in Settings.__dataclass_fields__.items()}
    changes: dict[str, int] = {}
    dram_how = _given(sources, "dram_bytes", "--dram")
    if "dram_bytes" in auto:
        import psutil

        others = [o for o in running if o.dram_bytes]
        changes["dram_bytes"], dram_how = auto_dram_bytes(
            psutil.virtual_memory().available, sum(int(o.dram_bytes) for o in others), len(others),
            caps["dram_bytes"])
    nvme_how = _given(sources, "nvme_bytes", "--nvme")
    dirs = drive_dirs(settings.nvme_dir)
    if "nvme_bytes" in auto and dirs:  # no directory: refused by the NVMe checks
        changes["nvme_bytes"], nvme_how = auto_nvme_bytes(_drive_rooms(dirs, running), caps["nvme_bytes"])
    sized = replace(settings, **changes)
    line = (f"budgets: DRAM {human_bytes(sized.dram_bytes)} ({dram_how}), "
            f"NVMe {human_bytes(sized.nvme_bytes)} ({nvme_how})")
    return Budgets(sized, line)


def _given(sources: Mapping[str, str] | None, name: str, flag: str) -> str:
    source = sources.get(name) if sources is not None else None
    if source is None:
        return "as given"
    return f"set by {flag}" if source == "flag" else f"from {source}"


def _drive_rooms(dirs: Sequence[str], running: Sequence) -> list[DriveRoom]:
    """Each drive's free space, what kvtier already stores there and what the ``running`` instances
    promised on its filesystem; weighted as ``split_budget`` will split the budget."""
    from kvtier.tiers.nvme.drives import split_budget

    drives = []
    for raw, weight in zip(dirs, split_budget(dirs, 1 << 40)):
        path = Path(raw).expanduser()
        try:
            free = shutil.disk_usage(nearest_existing(path.absolute())).free
        except OSError as exc:
            raise ConfigError(f"cannot use NVMe dir {raw}: {exc.strerror}",
                              hint="pass --nvme-dir a writable directory on a local SSD") from None
        promised, others = _promises(path, running)
        drives.append(DriveRoom(raw, free, max(1, weight), stored_bytes(path) if path.is_dir() else 0,
                                promised, others))
    return drives


def check_dram(settings: Settings, running: Sequence = ()) -> list[str]:
    """:func:`dram_fits` for this machine's RAM now and the ``running`` instances' DRAM budgets."""
    import psutil

    memory = psutil.virtual_memory()
    others = [o for o in running if o.dram_bytes]
    return dram_fits(settings.dram_bytes, memory.available, memory.total,
                     sum(int(o.dram_bytes) for o in others), len(others))


def dram_fits(budget: int, available: int, total: int, promised: int = 0, others: int = 0) -> list[str]:
    """A DRAM budget against the machine's RAM (``available`` now, ``total``) and what ``others``
    live instances promised their DRAM tiers; returns warnings.

    Refused when it is more than the RAM available now, or when it and the others' budgets add up
    to more than the machine's RAM (they cannot all fill).  Between the two -- it fits now, but not
    once the others fill their tiers -- is a warning, not a refusal: a tier pinned with CUDA is
    resident from the start and already out of "available", so counting it again would refuse
    layouts that fit (eight GPUs' instances each with a large pinned tier)."""
    if budget > available:
        raise ConfigError(
            f"dram budget {human_bytes(budget)} is more than this machine's available RAM ({human_bytes(available)})",
            hint="lower --dram (leave room for vLLM and the model weights), e.g. --dram 4GiB, or leave it out "
                 "(sized to the box)")
    if budget + promised > total:
        raise ConfigError(
            f"dram budget {human_bytes(budget)} plus the DRAM budgets of {_instances(others)} on this box "
            f"({human_bytes(promised)}) is more than its RAM ({human_bytes(total)})",
            hint=f"lower --dram (at most {human_bytes(max(0, total - promised))} beside them, less what vLLM "
                 "needs), or stop another instance")
    if budget > available - promised:
        return [f"dram budget {human_bytes(budget)} fits the {human_bytes(available)} of RAM available now, "
                f"but not once {_instances(others)} fill their DRAM tiers ({human_bytes(promised)}), unless "
                "those are already resident (pinned with CUDA)"]
    return []
