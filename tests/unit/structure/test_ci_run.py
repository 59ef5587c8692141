"""``.ci/run`` requires the real path: run for real (a copy of the script, in a scratch checkout whose
README names a small test command), it fails when vLLM cannot be imported, lists every skip by reason,
and fails on a skip that is not missing hardware. vLLM is hidden by a package of that name on
``PYTHONPATH`` whose import fails, as a broken install's would."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TESTS = REPO / "tests"


def scratch_checkout(tmp_path: Path, test_body: str, hide_vllm: bool) -> Path:
    """A checkout with .ci/run, one test file, and a README whose test command runs it with our plugin."""
    root = tmp_path / "checkout"
    (root / ".ci").mkdir(parents=True)
    shutil.copy2(REPO / ".ci" / "run", root / ".ci" / "run")
    (root / "test_probe.py").write_text("import pytest\n\n\n" + test_body)
    path = [str(TESTS)]
    if hide_vllm:
        hidden = tmp_path / "hide" / "vllm"
        hidden.mkdir(parents=True)
        (hidden / "__init__.py").write_text("raise ImportError('vllm is broken here (hidden by the test)')\n")
        path.insert(0, str(hidden.parent))
    command = (f"PYTHONPATH={':'.join(path)} {sys.executable} -m pytest -q -p no:cacheprovider "
               f"-p support.realpath test_probe.py")
    (root / "README.md").write_text(f"# probe\n\n<!-- test-command -->\n```bash\n{command}\n```\n")
    return root


def ci_run(root: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_CI"}  # .ci/run sets it itself
    return subprocess.run(["bash", str(root / ".ci" / "run")], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None and shutil.which("valkey-server") is None,
                                 reason="no redis-server: .ci/run would install it (apt-get install redis-server)")


@needs_redis
def test_ci_run_fails_when_vllm_cannot_be_imported(tmp_path):
    done = ci_run(scratch_checkout(tmp_path, "def test_nothing():\n    pass\n", hide_vllm=True))
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "vLLM cannot be imported" in out and "hidden by the test" in out


@needs_redis
def test_ci_run_passes_with_vllm_and_fails_on_an_unexpected_skip(tmp_path):
    expected = 'def test_gpu():\n    pytest.skip("needs a CUDA GPU")\n\n\ndef test_ok():\n    pass\n'
    done = ci_run(scratch_checkout(tmp_path / "a", expected, hide_vllm=False))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped:" in done.stdout and "needs a CUDA GPU" in done.stdout
    unexpected = expected + '\n\ndef test_redis():\n    pytest.skip("no redis-server")\n'
    done = ci_run(scratch_checkout(tmp_path / "b", unexpected, hide_vllm=False))
    assert done.returncode != 0
    assert "2 skipped:" in done.stdout and "unexpected skips in CI" in done.stdout and "no redis-server" in done.stdout


def test_outside_ci_a_skip_is_listed_and_passes(tmp_path):
    (tmp_path / "test_probe.py").write_text('import pytest\n\n\ndef test_x():\n    pytest.skip("no widget")\n')
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_CI"} | {"PYTHONPATH": str(TESTS)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "support.realpath",
                           "test_probe.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "1 skipped:" in done.stdout and "no widget" in done.stdout
