"""kvtier's background threads leave the cores vLLM's CPU backend binds the forward pass to."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtier.tiers.threads import forward_cores, plan_spare


def test_the_forward_cores_are_every_ranks_binding_or_this_workers_own():
    assert forward_cores({"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7"}, own={0}) == set(range(8))
    assert forward_cores({"VLLM_CPU_OMP_THREADS_BIND": "0,2|5"}, own={0}) == {0, 2, 5}
    assert forward_cores({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, own={1}) == {1}
    assert forward_cores({}, own={3}) == {3}


def test_the_spare_cores_are_the_engines_less_every_ranks_forward_cores():
    assert plan_spare({0}, {0, 1}, {}) == frozenset({1})  # one rank on core 0, core 1 reserved
    assert plan_spare({0}, {0, 1, 2, 3}, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) == frozenset({2, 3})  # TP=2
    assert plan_spare({0}, {0, 1}, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) is None  # TP=2 on 2 cores: none left
    assert plan_spare({0, 1}, {0, 1}, {}) is None  # not bound (a GPU worker, an in-process engine): stay


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two cores")
def test_a_thread_of_a_bound_worker_moves_to_the_cores_left_over():
    """A real child process bound to one core (as vLLM binds its worker) starts a thread that asks
    to move: the thread runs on the other cores, the process's main thread stays."""
    first = min(os.sched_getaffinity(0))
    code = f"""
import os, threading
os.sched_setaffinity(0, {{{first}}})
from kvtier.tiers.threads import off_forward_cores
seen = {{}}
def run():
    seen['moved'] = off_forward_cores()
    seen['cores'] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=run); t.start(); t.join()
print(seen['moved'], seen['cores'], sorted(os.sched_getaffinity(0)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="auto")).stdout.split(" ", 1)
    others = sorted(os.sched_getaffinity(0) - {first})
    assert out[0] == "True"
    assert out[1].strip() == f"{others} {[first]}"
