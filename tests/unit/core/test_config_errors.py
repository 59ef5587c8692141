"""Tests for kvtier.config (precedence, sizes, validation) and kvtier.errors (exit codes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import errors
from kvtier.config import Settings, find_config_file, load_settings, parse_size
from kvtier.errors import (
    CapacityError,
    ConfigError,
    CorruptBlockError,
    FingerprintMismatchError,
    KvtierError,
    NoServerError,
    NotFoundError,
    SnapshotError,
    StorageError,
    StorageFullError,
    UsageError,
    exit_code_for,
    render_error,
)

GiB = 2**30
MiB = 2**20


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    return path


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Run in an empty cwd with an env whose XDG dirs point into tmp_path."""
    monkeypatch.chdir(tmp_path)
    return {"XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_CACHE_HOME": str(tmp_path / "cache")}


# --- precedence ------------------------------------------------------------------------------


def test_defaults_when_nothing_is_set(isolated: dict[str, str], tmp_path: Path) -> None:
    settings, sources = load_settings(env=isolated)
    assert settings.dram_bytes == 4 * GiB
    assert settings.nvme_bytes == 64 * GiB
    assert settings.policy == "lru"
    assert (settings.high_watermark, settings.low_watermark) == (0.90, 0.75)
    assert settings.io_threads == 8 and settings.direct_io == "auto"
    assert settings.warm_codec == settings.cold_codec == "none"
    assert settings.nvme_dir == str(tmp_path / "cache" / "kvtier" / "nvme")
    assert settings.snapshot_dir == str(tmp_path / "cache" / "kvtier" / "snapshots")
    assert set(sources) == {f for f in Settings.__dataclass_fields__}
    assert set(sources.values()) == {"default"}


def test_flag_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'dram_bytes = "1GiB"\nnvme_bytes = "2GiB"\nio_threads = 3\n')
    env = {"KVTIER_DRAM_BYTES": "2GiB", "KVTIER_NVME_BYTES": "3GiB"}
    settings, sources = load_settings(flags={"dram_bytes": "5GiB"}, env=env, toml_path=path)
    assert settings.dram_bytes == 5 * GiB and sources["dram_bytes"] == "flag"
    assert settings.nvme_bytes == 3 * GiB and sources["nvme_bytes"] == "env KVTIER_NVME_BYTES"
    assert settings.io_threads == 3 and sources["io_threads"] == f"file {path}"
    assert settings.policy == "lru" and sources["policy"] == "default"


def test_none_flags_are_ignored(isolated: dict[str, str]) -> None:
    env = {**isolated, "KVTIER_POLICY": "arc"}
    settings, sources = load_settings(flags={"policy": None, "io_threads": 8}, env=env)
    assert settings.policy == "arc" and sources["policy"] == "env KVTIER_POLICY"
    assert settings.io_threads == 8 and sources["io_threads"] == "flag"


def test_env_strings_are_coerced(isolated: dict[str, str]) -> None:
    env = {**isolated, "KVTIER_HIGH_WATERMARK": "0.95", "KVTIER_LOW_WATERMARK": " 0.5 ",
           "KVTIER_IO_THREADS": "16", "KVTIER_POLICY": "ARC", "KVTIER_NVME_DIR": "/mnt/nvme0"}
    settings, sources = load_settings(env=env)
    assert settings.high_watermark == 0.95 and settings.low_watermark == 0.5
    assert settings.io_threads == 16 and settings.policy == "arc"
    assert settings.nvme_dir == "/mnt/nvme0" and sources["nvme_dir"] == "env KVTIER_NVME_DIR"


def test_bad_env_value_names_key_and_source(isolated: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env={**isolated, "KVTIER_IO_THREADS": "many"})
    assert "io_threads" in info.value.message and "KVTIER_IO_THREADS" in info.value.message
    assert info.value.hint


# --- aliases ---------------------------------------------------------------------------------


def test_env_aliases(isolated: dict[str, str]) -> None:
    settings, sources = load_settings(env={**isolated, "KVTIER_DRAM": "8G", "KVTIER_NVME": "1TiB"})
    assert settings.dram_bytes == 8 * GiB and sources["dram_bytes"] == "env KVTIER_DRAM"
    assert settings.nvme_bytes == 2**40 and sources["nvme_bytes"] == "env KVTIER_NVME"


def test_canonical_env_name_beats_alias(isolated: dict[str, str]) -> None:
    env = {**isolated, "KVTIER_DRAM": "8G", "KVTIER_DRAM_BYTES": "2G"}
    settings, sources = load_settings(env=env)
    assert settings.dram_bytes == 2 * GiB and sources["dram_bytes"] == "env KVTIER_DRAM_BYTES"


def test_toml_aliases_and_int_sizes(tmp_path: Path) -> None:
    path = write_toml(tmp_path, f'dram = "512MiB"\nnvme = {3 * GiB}\npolicy = "arc"\n')
    settings, sources = load_settings(env={}, toml_path=path)
    assert settings.dram_bytes == 512 * MiB and settings.nvme_bytes == 3 * GiB
    assert sources["dram_bytes"] == sources["nvme_bytes"] == sources["policy"] == f"file {path}"


def test_toml_alias_and_canonical_together_is_an_error(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'dram = "1G"\ndram_bytes = "2G"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(env={}, toml_path=path)
    assert info.value.hint


# --- automatic budgets ------------------------------------------------------------------------


def test_budgets_left_unset_or_set_to_auto_are_automatic(isolated: dict[str, str], tmp_path: Path) -> None:
    from kvtier.config import auto_budgets

    settings, sources = load_settings(env=isolated)
    assert auto_budgets(sources) == {"dram_bytes", "nvme_bytes"}
    assert (settings.dram_bytes, settings.nvme_bytes) == (4 * GiB, 64 * GiB)  # the caps, until sized
    settings, sources = load_settings(flags={"nvme": "AUTO", "dram": "2GiB"}, env=isolated)
    assert auto_budgets(sources) == {"nvme_bytes"} and sources["nvme_bytes"] == "flag (auto)"
    assert settings.nvme_bytes == 64 * GiB and settings.dram_bytes == 2 * GiB
    env = {**isolated, "KVTIER_DRAM": "auto"}
    path = write_toml(tmp_path, 'nvme = "8GiB"\ndram = "1GiB"\n')
    settings, sources = load_settings(env=env, toml_path=path)
    assert auto_budgets(sources) == {"dram_bytes"} and sources["dram_bytes"] == "env KVTIER_DRAM (auto)"
    assert settings.nvme_bytes == 8 * GiB
    # a flag beats an "auto" below it, and "auto" in the file is automatic too
    path = write_toml(tmp_path, 'nvme = "auto"\n')
    _settings, sources = load_settings(env=isolated, toml_path=path)
    assert auto_budgets(sources) == {"dram_bytes", "nvme_bytes"}
    _settings, sources = load_settings(flags={"nvme": "5GiB"}, env=isolated, toml_path=path)
    assert auto_budgets(sources) == {"dram_bytes"}


def test_a_bad_budget_says_auto_is_allowed(isolated: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(flags={"nvme": "autumn"}, env=isolated)
    assert "nvme_bytes" in info.value.message and "or auto" in info.value.hint


# --- config file discovery -------------------------------------------------------------------


def test_kvtier_config_env_selects_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'policy = "arc"\n')
    settings, sources = load_settings(env={"KVTIER_CONFIG": str(path)})
    assert settings.policy == "arc" and sources["policy"] == f"file {path}"


def test_cwd_file_then_xdg_file(isolated: dict[str, str], tmp_path: Path) -> None:
    xdg = tmp_path / "cfg" / "kvtier"
    xdg.mkdir(parents=True)
    (xdg / "kvtier.toml").write_text("io_threads = 7\n")
    assert find_config_file(isolated) == xdg / "kvtier.toml"
    assert load_settings(env=isolated)[0].io_threads == 7
    (tmp_path / "kvtier.toml").write_text("io_threads = 9\n")
    assert load_settings(env=isolated)[0].io_threads == 9


def test_missing_explicit_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env={"KVTIER_CONFIG": str(tmp_path / "nope.toml")})
    assert "nope.toml" in info.value.message and info.value.hint


# --- parse_size ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("123", 123),
        ("8GiB", 8 * GiB),
        ("8G", 8 * GiB),
        ("8GB", 8 * GiB),
        ("8gib", 8 * GiB),
        (" 8 GiB ", 8 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("512MiB", 512 * MiB),
        ("512m", 512 * MiB),
        ("64KB", 64 * 1024),
        ("2TiB", 2 * 2**40),
        ("1t", 2**40),
        ("100B", 100),
        (2.0, 2),
    ],
)
def test_parse_size_accepts(text: str | int | float, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "eight GiB", "8 XB", "-1GiB", "8GiBs", "1.2.3G", -5, True])
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(text)  # type: ignore[arg-type]
    assert info.value.hint and "GiB" in info.value.hint


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        ({"low_watermark": 0.9, "high_watermark": 0.9}, "low_watermark"),
        ({"low_watermark": 0.95}, "low_watermark"),
        ({"high_watermark": 1.5}, "high_watermark"),
        ({"low_watermark": 0.0}, "low_watermark"),
        ({"policy": "fifo"}, "policy"),
        ({"direct_io": "maybe"}, "direct_io"),
        ({"io_threads": 0}, "io_threads"),
        ({"io_threads": 65}, "io_threads"),
        ({"dram_bytes": 0}, "dram_bytes"),
        ({"nvme_bytes": "0GiB"}, "nvme_bytes"),
        ({"dram_bytes": "lots"}, "dram_bytes"),
    ],
)
def test_validation_errors_name_key_and_source(isolated: dict[str, str], flags: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(flags=flags, env=isolated)
    assert key in info.value.message and "flag" in info.value.message
    assert info.value.hint


def test_validation_error_names_env_source(isolated: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env={**isolated, "KVTIER_POLICY": "mru"})
    assert "policy" in info.value.message and "env KVTIER_POLICY" in info.value.message
    assert "lru" in (info.value.hint or "") and "arc" in (info.value.hint or "")


def test_unknown_toml_key(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'dram_size = "8GiB"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(env={}, toml_path=path)
    assert "dram_size" in info.value.message and str(path) in info.value.message
    assert info.value.hint and "dram_bytes" in info.value.hint


def test_malformed_toml(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "dram_bytes = = 8\n[[[\n")
    with pytest.raises(ConfigError) as info:
        load_settings(env={}, toml_path=path)
    assert str(path) in info.value.message and info.value.hint


def test_wrong_toml_type(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "policy = 3\n")
    with pytest.raises(ConfigError) as info:
        load_settings(env={}, toml_path=path)
    assert "policy" in info.value.message and f"file {path}" in info.value.message


def test_unknown_flag(isolated: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        load_settings(flags={"dram_gigs": 4}, env=isolated)


def test_config_error_is_a_usage_error() -> None:
    assert issubclass(ConfigError, UsageError)
    assert exit_code_for(ConfigError("bad")) == 2


def test_settings_are_frozen() -> None:
    from dataclasses import FrozenInstanceError

    with pytest.raises(FrozenInstanceError):
        Settings().policy = "arc"  # type: ignore[misc]


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (KvtierError("x"), 1),
        (UsageError("x"), 2),
        (ConfigError("x"), 2),
        (NoServerError("x"), 3),
        (NotFoundError("x"), 4),
        (StorageError("x"), 1),
        (StorageFullError("x"), 1),
        (CapacityError("x"), 1),
        (CorruptBlockError("x", path="/tmp/b"), 1),
        (SnapshotError("x"), 1),
        (FingerprintMismatchError("x"), 1),
        (ValueError("x"), 1),
        (KeyboardInterrupt(), 1),
    ],
)
def test_exit_code_for(exc: BaseException, code: int) -> None:
    assert exit_code_for(exc) == code


def test_exit_code_constants() -> None:
    assert (errors.EXIT_OK, errors.EXIT_FAILURE, errors.EXIT_USAGE) == (0, 1, 2)
    assert (errors.EXIT_NO_SERVER, errors.EXIT_NOT_FOUND) == (3, 4)


def test_hierarchy_and_attributes() -> None:
    assert issubclass(StorageFullError, StorageError) and issubclass(CorruptBlockError, StorageError)
    assert issubclass(FingerprintMismatchError, SnapshotError)
    exc = CorruptBlockError("checksum mismatch", hint="re-run", path=Path("/x/blk"))
    assert exc.path == "/x/blk" and str(exc) == "checksum mismatch"
    assert SnapshotError("s").path is None
    assert FingerprintMismatchError("f", path="/snap").path == "/snap"


def test_render_error() -> None:
    assert render_error(NotFoundError("no session 'a'")) == "error: no session 'a'"
    rendered = render_error(NoServerError("no server on :8000", hint="start one with kvtier serve"))
    assert rendered == "error: no server on :8000\nhint: start one with kvtier serve"
    exc = KvtierError("m", "h")
    assert (exc.message, exc.hint, str(exc)) == ("m", "h", "m")


def test_errors_and_config_import_no_heavy_modules() -> None:
    code = (
        "import sys, kvtier.errors, kvtier.config\n"
        "bad = [m for m in ('torch', 'vllm', 'textual', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(
        Path(__file__).resolve().parents[3])})


def test_codecs_from_env_and_toml_are_checked(isolated: dict[str, str], tmp_path: Path) -> None:
    settings, sources = load_settings(env={**isolated, "KVTIER_WARM_CODEC": "fp8"})
    assert settings.warm_codec == "fp8" and sources["warm_codec"].startswith("env")
    with pytest.raises(ConfigError) as err:
        load_settings(env={**isolated, "KVTIER_COLD_CODEC": "int3"})
    assert "cold_codec" in err.value.message and "int4-lc" in err.value.hint
    path = tmp_path / "kvtier.toml"
    path.write_text('warm_codec = "int4-lc:g32+zstd"\ncold_codec = "fp8:e3m4"\n')
    with pytest.raises(ConfigError) as err:
        load_settings(env=isolated, toml_path=path)
    assert "cold_codec" in err.value.message


# ---- the connector's config: parsed once, the same keys both ways -----------------------------------
def test_connector_config_round_trips_and_refuses_typos():
    from kvtier.config import Settings
    from kvtier.connector_config import ConnectorConfig
    from kvtier.launch.serve import build_kv_transfer_config

    extra = build_kv_transfer_config(Settings(), "tiny", "http://127.0.0.1:8000/v1", "/run/kvtier/a.sock",
                                     instance="a")["kv_connector_extra_config"]
    config = ConnectorConfig.from_extra(extra)
    assert config.to_extra() == extra
    assert (config.high_watermark, config.low_watermark, config.dram_bytes) == \
        (Settings().high_watermark, Settings().low_watermark, Settings().dram_bytes)  # one set of defaults
    assert ConnectorConfig.from_extra({"catalog": "off", "io_threads": "4", "nvme_dir": ""}).catalog is False
    assert ConnectorConfig.from_extra({"io_threads": "4"}).io_threads == 4
    assert ConnectorConfig.from_extra({"nvme_dir": ""}).nvme_dir is None
    assert ConnectorConfig.from_extra({"dram_bytes": 8 << 30}).shard_budgets(2) == (4 << 30, 0)
    with pytest.raises(ConfigError, match="unknown kvtier connector setting.*high_watermak"):
        ConnectorConfig.from_extra({"high_watermak": 0.8})
    with pytest.raises(ConfigError, match="io_threads"):
        ConnectorConfig.from_extra({"io_threads": "many"})
