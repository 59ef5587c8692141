"""The vLLM API check (``kvtier doctor --vllm-source``) on real vLLM sources: the installed 0.32, and
0.33's files as shipped in its wheel (tests/data/vllm-0.33.0, unmodified). Each mismatch it must
catch is made for real in a copy of those files: a renamed hook, a changed parameter, a new abstract
hook, a moved internal, a dropped request field."""
from __future__ import annotations

import json
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.diagnose.vllm_api import Signature, check_api
from kvtier.plugins.vllm.compat import LATER_HOOKS, api_spec

V033 = Path(__file__).resolve().parents[2] / "data" / "vllm-0.33.0" / "vllm"
BASE = "distributed/kv_transfer/kv_connector/v1/base.py"
SLEEP_HOOKS = sorted(LATER_HOOKS)


def installed_vllm() -> Path:
    spec = find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def rows_named(report: dict, name: str) -> list[dict]:
    return [row for row in report["rows"] if row["name"] == name]


def test_the_installed_vllm_0_32_fits_and_never_calls_the_sleep_hooks():
    report = check_api(installed_vllm(), api_spec())
    if report["version"] != "0.32.0":
        pytest.skip(f"the installed vLLM is {report['version']}, this test reads 0.32.0")
    assert report["ok"], report["problems"]
    assert report["new_hooks"] == []
    for hook in SLEEP_HOOKS:  # kvtier defines them; 0.32 has no such hooks, and says so
        [row] = rows_named(report, f"KVTierConnector.{hook}")
        assert row["ok"] and "never called" in row["detail"]
    [row] = rows_named(report, "KVTierConnector.start_load_kv")
    assert row["ok"] and row["detail"] == "method, parameters match"


def test_vllm_0_33_sources_fit_and_their_new_hooks_are_overridden():
    report = check_api(V033, api_spec())
    assert report["version"] == "0.33.0"
    assert report["ok"], report["problems"]
    assert report["new_hooks"] == SLEEP_HOOKS
    assert {row["detail"] for row in report["rows"] if row["what"] == "new hook"} == {"overridden by kvtier"}
    names = {row["name"] for row in report["rows"]}
    assert {"Request.session_id", "Request.block_hashes", "Request.cache_salt", "SchedulerOutput.preempted_req_ids",
            "vllm.v1.core.kv_cache_utils.NONE_HASH", "vllm.platforms.current_platform"} <= names


def doctored(tmp_path: Path, path: str, old: str, new: str) -> Path:
    """A copy of the 0.33 sources with one edit in one file (the edit must apply exactly once)."""
    root = tmp_path / "vllm"
    shutil.copytree(V033, root)
    text = (root / path).read_text()
    assert text.count(old) == 1, (path, old)
    (root / path).write_text(text.replace(old, new))
    return root


BREAKS = [
    ("a hook renamed", BASE, "    def register_kv_caches(self, kv_caches",
     "    def register_kv_cache_tensors(self, kv_caches", "KVTierConnector.register_kv_caches: not a hook"),
    ("a parameter renamed", BASE, "    def start_load_kv(self, forward_context: \"ForwardContext\", **kwargs: Any)",
     "    def start_load_kv(self, ctx: \"ForwardContext\", **kwargs: Any)",
     "KVTierConnector.start_load_kv: parameter 1 is `ctx` in vLLM, `forward_context` in kvtier"),
    ("a parameter added", BASE, "    def wait_for_layer_load(self, layer_name: str) -> None:",
     "    def wait_for_layer_load(self, layer_name: str, stream: int) -> None:",
     "KVTierConnector.wait_for_layer_load: vLLM passes `stream`"),
    ("a classmethod made a method", BASE,
     "    @classmethod\n    def supports_sleep_mode(cls, kv_transfer_config",
     "    def supports_sleep_mode(self, kv_transfer_config",
     "KVTierConnector.supports_sleep_mode: a classmethod in kvtier, a method in vLLM"),
    ("a new abstract hook", BASE, "    def restore_kv_caches(self) -> None:",
     "    @abstractmethod\n    def must_implement(self) -> None:\n        return\n\n"
     "    def restore_kv_caches(self) -> None:",
     "KVTierConnector.must_implement: abstract"),
    ("a request field dropped", "v1/request.py", "        self.block_hashes: list[BlockHash] = []",
     "        self.hashes: list[BlockHash] = []", "Request.block_hashes: Request has no field"),
    ("a scheduler output field dropped", "v1/core/sched/output.py", "    preempted_req_ids: set[str] | None = None",
     "    evicted_req_ids: set[str] | None = None", "SchedulerOutput.preempted_req_ids"),
    ("an internal moved", "v1/core/kv_cache_utils.py", "def hash_block_tokens(", "def hash_tokens_of_block(",
     "vllm.v1.core.kv_cache_utils.hash_block_tokens: vllm.v1.core.kv_cache_utils no longer defines"),
]


@pytest.mark.parametrize("path, old, new, problem", [b[1:] for b in BREAKS], ids=[b[0] for b in BREAKS])
def test_a_doctored_copy_fails_the_check(tmp_path, path, old, new, problem):
    report = check_api(doctored(tmp_path, path, old, new), api_spec())
    assert not report["ok"]
    assert any(p.startswith(problem) for p in report["problems"]), report["problems"]
    assert len(report["problems"]) == 1  # the one break, nothing else


def test_a_missing_module_is_a_problem(tmp_path):
    root = tmp_path / "vllm"
    shutil.copytree(V033, root)
    (root / "utils" / "hashing.py").unlink()
    assert check_api(root, api_spec())["problems"] == \
        ["vllm.utils.hashing.get_hash_fn_by_name: module vllm.utils.hashing is gone"]


@pytest.mark.parametrize("ours, base, why", [
    ("def f(self, a, b=1): pass", "def f(self, a): pass", None),  # an extra parameter with a default: fine
    ("def f(self, a, **kw): pass", "def f(self, a, *, b=None): pass", None),  # **kwargs takes b=
    ("def f(self, a): pass", "def f(self, a, *, b=None): pass", "vLLM passes `b=`"),
    ("def f(self, a): pass", "def f(self, a=None): pass", "vLLM may leave out `a`"),
    ("def f(self, a, b): pass", "def f(self, a): pass", "kvtier requires `b`"),
    ("def f(self, a): pass", "def f(self, a, **kw): pass", "vLLM may pass more keyword arguments"),
])
def test_signatures_accept_what_the_base_allows(ours, base, why):
    import ast

    got = Signature.of(ast.parse(ours).body[0]).accepts_calls_of(Signature.of(ast.parse(base).body[0]))
    assert (got is None) if why is None else (got is not None and why in got)


def test_doctor_vllm_source_prints_and_exits_1_on_a_mismatch(tmp_path):
    runner = CliRunner()
    good = runner.invoke(app, ["doctor", "--vllm-source", str(V033), "--json"])
    assert good.exit_code == 0, good.output
    assert json.loads(good.output)["ok"] is True
    bad_dir = doctored(tmp_path, "v1/request.py", "        self.cache_salt: str | None = cache_salt",
                       "        self.salt: str | None = cache_salt")
    bad = runner.invoke(app, ["doctor", "--vllm-source", str(bad_dir)])
    assert bad.exit_code == 1
    assert "MISMATCH" in bad.output and "Request.cache_salt" in bad.output
    errors = [line for line in bad.output.splitlines() if line.startswith(("error:", "hint:"))]
    assert len(errors) == 2 and "1 problem, first Request.cache_salt" in errors[0] and "pip install" in errors[1]
    missing = runner.invoke(app, ["doctor", "--vllm-source", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "not a vLLM package directory" in missing.output


def test_doctor_json_reports_the_vllm_version_and_whether_it_was_tested(tmp_path):
    installed_vllm()
    out = CliRunner().invoke(app, ["doctor", "--json", "--quick", "--nvme-dir", str(tmp_path / "nvme"), "--socket",
                                   str(tmp_path / "none.sock"), "--link-gbps", "pcie=0.1"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output[out.output.index("{"):])
    vllm = report["vllm"]
    assert vllm["version"] == "0.32.0" and vllm["tested"] is True and vllm["range"] == ">=0.32.0,<0.34"
    assert vllm["api_check"]["ok"] is True
    assert not any("vLLM" in warning for warning in report["warnings"])


@pytest.mark.parametrize("version, flagged", [("0.34.0", "newer than kvtier's supported range"),
                                              ("0.33.1", "was not tested"), ("0.32.0", None), ("0.33.0", None)])
def test_doctor_flags_a_vllm_kvtier_was_not_tested_with(version, flagged):
    from kvtier.diagnose.doctor import vllm_warnings
    from kvtier.plugins.vllm.compat import vllm_info

    warnings = vllm_warnings(vllm_info(version))
    assert (warnings == []) if flagged is None else (len(warnings) == 1 and flagged in warnings[0])
    broken = {**vllm_info("0.32.0"), "api_check": {"ok": False, "problems": ["Request.cache_salt: gone"]}}
    assert vllm_warnings(broken) == ["kvtier's connector does not fit the installed vLLM's sources: 1 mismatch, "
                                     "first Request.cache_salt: gone (kvtier doctor --vllm-source installed lists "
                                     "them)"]
