"""data.decode=device's torchcodec is the extra loadout[device-decode], not a dependency: torchcodec loads on torch
>= 2.11 alone while requirements.txt allows 2.6, and its wheels name no torch, so pip would install one that cannot
load. The declared floors agree, the image installs the extra only on a torch that loads it, and a run without it
names the extra in one line."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tomllib

import pytest

from tests.conftest import ROOT, run_cli

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


def load_check_torch():
    spec = importlib.util.spec_from_file_location("check_torch", ROOT / "docker" / "check_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_torch = load_check_torch()


def test_torchcodec_is_the_device_decode_extra_installed_by_dev_and_pinned_by_the_lock():
    assert not re.search(r"^torchcodec", (ROOT / "requirements.txt").read_text(), re.M), "a hard dependency"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert tuple(extras["device-decode"]) == check_torch.DECODE_EXTRA  # what the image installs
    assert set(extras["device-decode"]) <= set(extras["dev"])  # make setup (and so make lock) includes it
    assert re.search(r"^torchcodec==", (ROOT / "constraints.txt").read_text(), re.M)
    assert check_torch.DECODE_MIN_TORCH == gpu_check.MIN_TORCH_DECODE > gpu_check.MIN_TORCH
    floor = re.search(r"^torch>=(\S+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert check_torch.release(floor) == gpu_check.MIN_TORCH


@pytest.mark.parametrize(("torch_version", "installed"), [
    ("2.14.1+cu130", True),  # the lock's
    ("2.11.0", True),
    ("2.14.0a0+ngc1a2b3c", True),  # an NGC build of a new enough torch
    ("2.10.0a0+b4e4ee81d3", False),  # NGC 25.12's: torchcodec would not load
    ("2.6.0", False),
])
def test_the_image_installs_the_extra_only_on_a_torch_that_loads_it(torch_version, installed):
    assert check_torch.decode_requirements(torch_version) == (check_torch.DECODE_EXTRA if installed else ())


@pytest.mark.slow
def test_decode_device_without_torchcodec_names_the_extra_in_one_line(small_run_args, tmp_path):
    """A PYTHONPATH whose `torchcodec` is not there as far as an import goes (ModuleNotFoundError)."""
    absent = tmp_path / "site" / "torchcodec"
    absent.mkdir(parents=True)
    (absent / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'torchcodec\'")\n')
    result = run_cli([*small_run_args, "data.decode=device", "data.num_workers=0"],
                     env={"PYTHONPATH": f"{absent.parent}{os.pathsep}{ROOT}"}, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0] == ("error: data.decode=device needs torchcodec (No module named 'torchcodec'): pip install "
                        "'loadout[device-decode]' (it needs torch >= 2.11), or use data.decode=cpu"), lines
