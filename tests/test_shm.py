"""The /dev/shm check: estimate, compare with the real free space of a real directory, warn with the fix."""

from __future__ import annotations

import logging
import os
import shutil
import warnings

import pytest

from loadout.data.loader import shm
from loadout.data.loader.plan import loader_shm_bytes
from loadout.data.loader.shm import check_shm, warn_if_shm_too_small


def test_estimate_counts_every_batch_in_flight():
    # 4 workers x 2 prefetched batches x 1 MiB x headroom 2
    assert loader_shm_bytes(4, 2, 1 << 20, headroom=1.0) == 16 << 20, "4 workers x (2 + 2) ring slots"
    assert loader_shm_bytes(4, 2, 1 << 20) == 20 << 20
    assert loader_shm_bytes(0, 2, 1 << 20) == 0, "no workers: batches never cross processes"
    with pytest.raises(ValueError):
        loader_shm_bytes(-1, 2, 1)


def test_check_shm_warns_when_free_space_is_too_small(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    message = check_shm(free + (1 << 30), path=str(tmp_path))
    assert message is not None
    assert "\n" not in message, "one line"
    assert str(tmp_path) in message
    # names every fix
    assert "shm_size" in message and "--shm-size" in message and "ipc" in message


def test_check_shm_silent_when_space_suffices(tmp_path):
    assert check_shm(1 << 20, path=str(tmp_path)) is None
    assert check_shm(0, path=str(tmp_path)) is None


def test_missing_shm_directory_gives_no_warning(tmp_path):
    assert check_shm(1 << 60, path=str(tmp_path / "no-such-dir")) is None  # macOS has no /dev/shm
    assert warn_if_shm_too_small(1 << 40, path=str(tmp_path / "no-such-dir")) is False


def test_warn_logs_and_warns(tmp_path, caplog):
    free = shutil.disk_usage(tmp_path).free
    with caplog.at_level(logging.WARNING, logger=shm.__name__), pytest.warns(RuntimeWarning, match="shm"):
        assert warn_if_shm_too_small(free + (1 << 30), path=str(tmp_path)) is True
    assert any("Bus error" in r.getMessage() and r.name == "loadout.data.loader.shm" for r in caplog.records)


def test_warn_silent_for_small_loader_and_for_zero_workers(tmp_path, caplog):
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_shm_too_small(1024, path=str(tmp_path)) is False
        free = shutil.disk_usage(tmp_path).free
        assert warn_if_shm_too_small(loader_shm_bytes(0, 2, free * 10), path=str(tmp_path)) is False
    assert not caplog.records


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this platform")
def test_real_dev_shm_default_path():
    free = shutil.disk_usage("/dev/shm").free
    assert check_shm(free + (1 << 30)) is not None
    assert check_shm(1) is None or free < 1
