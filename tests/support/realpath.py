"""What a CI run requires: the real path ran, not skips.

``.ci/run`` sets ``KVTIER_CI=1``. Then vLLM must import (checked once before any test, so a broken
vLLM fails the run in its first seconds instead of turning every vLLM-backed test into a skip), a
module a test needs (``need``) fails the test instead of skipping it, and a skip whose reason is not
one of ``EXPECTED_SKIPS`` (hardware this box may lack) fails the run. Every run prints its skips,
grouped by reason. A pytest plugin: ``tests/conftest.py`` loads it, ``-p support.realpath`` too."""
from __future__ import annotations

import importlib
import os
from collections import Counter
from types import ModuleType

import pytest

__all__ = ["EXPECTED_SKIPS", "in_ci", "need"]

# reasons a skip may have in CI: hardware or a kernel feature the CI box may lack, nothing installable
EXPECTED_SKIPS = ("needs a CUDA GPU", "this CPU has no AMX", "vLLM cannot run an fp8 KV cache on this CPU",
                  "needs Linux and two cores")


def in_ci() -> bool:
    return os.environ.get("KVTIER_CI") == "1"


def need(module: str, hint: str = "scripts/install.sh cpu,test") -> ModuleType:
    """``module``, imported; a skip where it is missing, a failure in CI (the real path must run)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if in_ci():
            pytest.fail(f"{module} cannot be imported in CI ({exc}); hint: {hint}", pytrace=False)
        pytest.skip(f"{module} is not installed ({hint})", allow_module_level=True)


def pytest_configure(config: pytest.Config) -> None:
    if not in_ci():
        return
    try:
        importlib.import_module("vllm")
    except Exception as exc:  # noqa: BLE001 - any failure to import is the same failure to CI
        pytest.exit(f"error: vLLM cannot be imported ({type(exc).__name__}: {exc}); CI runs the vLLM-backed "
                    f"tests, never skips them\nhint: install it with the README's command "
                    f"(scripts/install.sh cpu,test)", returncode=pytest.ExitCode.USAGE_ERROR)


def _skip_reasons(config: pytest.Config) -> Counter:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    reasons: Counter = Counter()
    for report in (reporter.stats.get("skipped", []) if reporter is not None else []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    return reasons


def unexpected(reasons: Counter) -> list[str]:
    return sorted(r for r in reasons if not r.startswith(EXPECTED_SKIPS))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if in_ci() and exitstatus == pytest.ExitCode.OK and unexpected(_skip_reasons(session.config)):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    reasons = _skip_reasons(config)
    if not reasons:
        return
    terminalreporter.write_line(f"{sum(reasons.values())} skipped:")
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"  {count:4d}  {reason}")
    bad = unexpected(reasons)
    if in_ci() and bad:
        terminalreporter.write_line("error: unexpected skips in CI (only missing hardware may skip there): "
                                    + "; ".join(bad), red=True)
