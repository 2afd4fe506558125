"""loadout/runtime/process.py: after `keep_large_blocks`, a batch-sized block freed and made again reuses its pages
instead of faulting in fresh ones (counted by the kernel, in a fresh interpreter); idle OpenMP threads sleep unless
the user said otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadout.runtime.process import idle_threads_sleep
from tests.conftest import ROOT

BLOCK = 40 << 20  # over glibc's largest default mmap threshold (32 MiB)
FAULTS_PER_ROUND = f"""
import resource, sys
from loadout.runtime.process import keep_large_blocks
if sys.argv[1] == "kept" and not keep_large_blocks({BLOCK}):
    sys.exit(3)
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = bytearray({BLOCK})  # every page written
    del block
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
HUGE_PAGES = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def faults(mode: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", FAULTS_PER_ROUND, mode], cwd=ROOT, capture_output=True, text=True)
    if done.returncode == 3:
        pytest.skip("this C library has no glibc mallopt, or refused the size")
    assert done.returncode == 0, done.stderr
    return [int(line) for line in done.stdout.split()]


@pytest.mark.skipif(HUGE_PAGES.exists() and "[always]" in HUGE_PAGES.read_text(),
                    reason="transparent huge pages always on: a fresh mapping takes a few huge-page faults")
def test_a_freed_batch_sized_block_is_reused_without_page_faults():
    pages = BLOCK // 4096
    assert min(faults("default")) > pages // 2  # glibc's default: a fresh mapping every time
    assert max(faults("kept")[2:]) < pages // 100  # the heap's pages, already there


def test_idle_openmp_threads_sleep_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    idle_threads_sleep()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    idle_threads_sleep()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
