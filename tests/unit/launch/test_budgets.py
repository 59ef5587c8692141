"""The arithmetic of ``kvtier serve``'s budgets on given figures (free space, RAM available, other
instances' promises): automatic sizes, their caps and floors, and the refusals of explicit ones.
``size_budgets`` is then run on this box's real disk with real registry records of other instances."""
from __future__ import annotations

import shutil

import pytest

from kvtier.config import load_settings
from kvtier.control.instances import Instance
from kvtier.errors import ConfigError
from kvtier.launch.budgets import (
    DRAM_AUTO_FLOOR,
    NVME_AUTO_FLOOR,
    DriveRoom,
    auto_dram_bytes,
    auto_nvme_bytes,
    dram_fits,
    size_budgets,
)

MiB, GiB = 2**20, 2**30
CAP_NVME, CAP_DRAM = 64 * GiB, 4 * GiB


def one_line(error: ConfigError) -> None:
    assert "\n" not in error.message and error.hint and "\n" not in error.hint


# ---- NVMe ----------------------------------------------------------------------------------------
def test_an_automatic_nvme_budget_is_half_the_room_left_on_the_disk():
    budget, how = auto_nvme_bytes([DriveRoom("/x", 80 * GiB)], CAP_NVME)
    assert budget == 40 * GiB
    assert how == "auto: ½ of 80.0 GiB free on /x"
    # another instance promised 30 GiB it has not filled: half of the 50 left
    budget, how = auto_nvme_bytes([DriveRoom("/x", 80 * GiB, promised=30 * GiB, others=1)], CAP_NVME)
    assert budget == 25 * GiB and "less 30.0 GiB promised to 1 other instance" in how
    # what this instance already stores there is its own room: a restart does not shrink the budget
    first, _ = auto_nvme_bytes([DriveRoom("/x", 80 * GiB)], CAP_NVME)
    again, how = auto_nvme_bytes([DriveRoom("/x", 80 * GiB - first, stored=first)], CAP_NVME)
    assert again == first and "kvtier already stores there" in how


def test_the_automatic_nvme_budget_is_capped_and_says_so():
    budget, how = auto_nvme_bytes([DriveRoom("/big", 3000 * GiB)], CAP_NVME)
    assert budget == CAP_NVME and how.endswith("capped at 64.0 GiB")


def test_servers_started_one_after_another_or_at_once_never_promise_one_disk_twice():
    free = 75 * GiB
    promised, budgets = 0, []
    for _ in range(4):  # each new server sees the earlier ones' budgets (nothing filled yet)
        budget, _how = auto_nvme_bytes([DriveRoom("/x", free, promised=promised, others=len(budgets))], CAP_NVME)
        budgets.append(budget)
        promised += budget
    assert sum(budgets) <= free and budgets == sorted(budgets, reverse=True)
    # two started at the same moment: neither registered yet, both take half -- still no more than the disk
    racing, _ = auto_nvme_bytes([DriveRoom("/x", free)], CAP_NVME)
    assert 2 * racing <= free


def test_several_drives_each_hold_their_share_within_half_their_room():
    drives = [DriveRoom("/a", 100 * GiB, weight=3), DriveRoom("/b", 10 * GiB, weight=1)]
    budget, how = auto_nvme_bytes(drives, CAP_NVME)
    shares = [budget * d.weight // 4 for d in drives]  # split by weight, as split_budget does
    assert all(share <= d.room // 2 for share, d in zip(shares, drives))
    assert budget == 20 * GiB  # /b limits it: its share (1/4) may be at most 5 GiB
    assert "2 drives" in how and "/a" in how and "/b" in how


def test_a_nearly_full_disk_is_refused_with_one_line_naming_it():
    with pytest.raises(ConfigError) as caught:
        auto_nvme_bytes([DriveRoom("/var/full", 120 * MiB)], CAP_NVME)
    one_line(caught.value)
    assert caught.value.message.startswith("120.0 MiB free on /var/full")
    assert "--nvme-dir on another drive" in caught.value.hint
    # just enough room for the floor is not refused; one byte less is
    assert auto_nvme_bytes([DriveRoom("/x", 2 * NVME_AUTO_FLOOR)], CAP_NVME)[0] == NVME_AUTO_FLOOR
    with pytest.raises(ConfigError):
        auto_nvme_bytes([DriveRoom("/x", 2 * NVME_AUTO_FLOOR - 2)], CAP_NVME)
    # a disk others have promised is as full as one with no free space; the short drive is named
    with pytest.raises(ConfigError, match=r"^1\.0 GiB free on /b, less 900\.0 MiB promised to 2 other instances"):
        auto_nvme_bytes([DriveRoom("/a", 500 * GiB), DriveRoom("/b", GiB, promised=900 * MiB, others=2)], CAP_NVME)


# ---- DRAM ----------------------------------------------------------------------------------------
def test_an_automatic_dram_budget_is_a_quarter_of_the_ram_left():
    budget, how = auto_dram_bytes(12 * GiB, cap=CAP_DRAM)
    assert budget == 3 * GiB and how == "auto: ¼ of 12.0 GiB available"
    budget, how = auto_dram_bytes(64 * GiB, cap=CAP_DRAM)
    assert budget == CAP_DRAM and how.endswith("capped at 4.0 GiB")
    budget, how = auto_dram_bytes(12 * GiB, promised=4 * GiB, others=1, cap=CAP_DRAM)
    assert budget == 2 * GiB and "less 4.0 GiB promised to 1 other instance" in how


def test_too_little_ram_for_an_automatic_dram_budget_is_refused():
    assert auto_dram_bytes(4 * DRAM_AUTO_FLOOR, cap=CAP_DRAM)[0] == DRAM_AUTO_FLOOR
    with pytest.raises(ConfigError) as caught:
        auto_dram_bytes(2 * GiB, promised=GiB + 512 * MiB, others=1, cap=CAP_DRAM)
    one_line(caught.value)
    assert caught.value.message.startswith("available RAM is 2.0 GiB, less 1.5 GiB promised to 1 other instance")
    assert "--dram" in caught.value.hint


def test_an_explicit_dram_budget_counts_the_other_instances():
    assert dram_fits(4 * GiB, available=10 * GiB, total=16 * GiB) == []
    assert dram_fits(4 * GiB, available=10 * GiB, total=16 * GiB, promised=4 * GiB, others=1) == []
    with pytest.raises(ConfigError, match="more than this machine's available RAM"):
        dram_fits(11 * GiB, available=10 * GiB, total=16 * GiB)
    # it fits now, but it and the others' budgets cannot all fill the machine's RAM
    with pytest.raises(ConfigError, match=r"plus the DRAM budgets of 2 other instances .*\(8\.0 GiB\)") as caught:
        dram_fits(9 * GiB, available=10 * GiB, total=16 * GiB, promised=8 * GiB, others=2)
    one_line(caught.value)
    assert "at most 8.0 GiB beside them" in caught.value.hint
    # fits the RAM, but not what is available now less the others' budgets: said, not refused
    # (a tier pinned with CUDA is resident already, and counted in both)
    warnings = dram_fits(7 * GiB, available=10 * GiB, total=16 * GiB, promised=8 * GiB, others=2)
    assert len(warnings) == 1 and "not once 2 other instances fill their DRAM tiers" in warnings[0]


# ---- on this box -----------------------------------------------------------------------------------
def other(name: str, **budgets) -> Instance:
    return Instance(name=name, pid=1, port=8100, host="127.0.0.1", api_url="u", admin_socket="s", model="m",
                    **budgets)


def test_size_budgets_sizes_only_the_automatic_ones_on_the_real_disk(tmp_path):
    nvme = tmp_path / "nvme"
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_CACHE_HOME": str(tmp_path), "KVTIER_NVME_DIR": str(nvme)}
    settings, sources = load_settings(flags={"dram": "1GiB"}, env=env)
    promise = 8 * GiB
    running = [other("a", nvme_dir=str(tmp_path / "elsewhere"), nvme_bytes=promise, dram_bytes=GiB)]
    before = shutil.disk_usage(tmp_path).free
    sized = size_budgets(settings, sources, running)
    after = shutil.disk_usage(tmp_path).free
    assert sized.settings.dram_bytes == GiB  # given: left as it is
    low, high = sorted((before, after))
    expected = [min(CAP_NVME, (free - promise) // 2) for free in (low - 64 * MiB, high + 64 * MiB)]
    assert expected[0] <= sized.settings.nvme_bytes <= expected[1]
    assert isinstance(sized.settings.nvme_bytes, int)  # bytes: what the registry records
    assert sized.line.startswith("budgets: DRAM 1.0 GiB (set by --dram), NVMe ")
    assert "less 8.0 GiB promised to 1 other instance" in sized.line
    # settings built in code (no sources) are taken as given
    assert size_budgets(settings, None, running).settings == settings
