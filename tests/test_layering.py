"""The packages' layering: each imports on its own in a fresh interpreter (no import circle hides behind the order
the entry points happen to import in)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("package", ["train.task", "train.data", "train.observe", "train.loop", "train.tune", "train"])
def test_every_package_imports_first_in_a_fresh_interpreter(package):
    result = subprocess.run([sys.executable, "-c", f"import {package}"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
