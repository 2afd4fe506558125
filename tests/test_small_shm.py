"""A container's small /dev/shm, for real: a private mount namespace with an 8 MiB tmpfs over /dev/shm.

The run must warn with the fix before any worker starts and stop with a one-line error, never a bus error.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _can_mount_private_shm() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _can_mount_private_shm(), reason="needs root and unshare -m to mount a tmpfs")


@pytest.mark.slow
def test_small_dev_shm_warns_then_fails_with_the_fix(tiny_dataset, tmp_path):
    args = ["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=64", "data.batch_size=64",
            "data.num_workers=2", "data.prefetch_factor=4", "trainer.max_steps=2", "trainer.progress=false",
            f"hydra.run.dir={tmp_path / 'run'}"]
    train = shlex.join([sys.executable, "-m", "train", *args])
    result = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=8m tmpfs /dev/shm && {train}"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "killed by signal" not in result.stderr
    assert "/dev/shm has" in result.stderr and "shm_size" in result.stderr, "the start-up warning names the fix"
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data.num_workers=2" in errors[0] and "shm_size" in errors[0], result.stderr[-3000:]
