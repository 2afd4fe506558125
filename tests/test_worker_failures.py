"""A dead worker or a timeout is an error naming the likely cause, never a hang (real DataLoader workers)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from train.data.loader import LoaderError, explain_loader_error

DATA_CFG = OmegaConf.create({"timeout": 1.0})


class DiesAt(Dataset):
    """Its worker kills itself (as the OOM killer or a bus error would) at one index."""

    def __init__(self, index: int):
        self.index = index

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        if i == self.index:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.zeros(3)


class Stalls(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        time.sleep(30)
        return torch.zeros(3)


def first_error(loader) -> BaseException:
    with pytest.raises(RuntimeError) as err:
        for _ in loader:
            pass
    return err.value


def test_killed_worker_becomes_an_error_naming_shm_and_memory():
    error = first_error(StatefulDataLoader(DiesAt(5), batch_size=4, num_workers=2))
    explained = explain_loader_error(error, DATA_CFG)
    assert isinstance(explained, LoaderError)
    assert "shm" in str(explained) and "data.num_workers" in str(explained)


def test_stalled_worker_times_out_with_the_key_to_raise():
    started = time.monotonic()
    error = first_error(StatefulDataLoader(Stalls(), batch_size=2, num_workers=1, timeout=1.0))
    assert time.monotonic() - started < 25  # the timeout fired; the sleep did not run out
    explained = explain_loader_error(error, DATA_CFG)
    assert isinstance(explained, LoaderError) and "data.timeout" in str(explained)


def test_other_errors_pass_through():
    assert explain_loader_error(RuntimeError("CUDA out of memory"), DATA_CFG) is None
