"""The loader explains itself (train/observe/doctor.py, train/data/loader/stages.py): each bottleneck, injected from
outside with real workers and real JPEG files, is named by the epoch's diagnosis, and its stage leads the stage
shares."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from tests.conftest import compose_config, read_metrics
from tests.tiny_net import TinyNet
from train.data import data_from_config
from train.data.augment import Recipe
from train.data.datasets import ImageFolderDataset
from train.data.loader.stages import DECODE, READ, SPLIT_EVERY, StageClock
from train.data.transforms import DirectCompose
from train.dist import DistEnv
from train.loop.engine import Trainer
from train.loop.model import build_model

CPU = torch.device("cpu")


class SlowReads(ImageFolderDataset):
    """A folder on a slow disk: every read waits 15 ms before the file comes."""

    def read_encoded(self, index: int) -> tuple[bytes, int]:
        time.sleep(0.015)
        return super().read_encoded(index)


class Burn:
    """An augment step that burns 8 ms of CPU a sample."""

    def __call__(self, image):
        end = time.thread_time() + 0.008
        while time.thread_time() < end:
            pass
        return image


class BurningRecipe(Recipe):
    def train_transform(self, data_cfg, input_size=None):
        return DirectCompose([Burn(), *super().train_transform(data_cfg, input_size).transforms])


class SlowNet(TinyNet):
    """A model that dominates: 40 ms a forward."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        time.sleep(0.04)
        return super().forward(images)


def run(tiny_dataset, tmp_path, caplog, *overrides: str) -> list[dict]:
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "data.num_workers=1", "trainer.epochs=1", "trainer.progress=false", "logger=[]",
                          "model._target_=tests.tiny_net.TinyNet", *overrides])
    with caplog.at_level(logging.INFO, logger="train.observe.doctor"), data_from_config(cfg, DistEnv(), CPU) as data:
        trainer = Trainer.from_config(cfg, DistEnv(), CPU, data, build_model(cfg.model, data.num_classes, CPU),
                                      tmp_path)
        trainer.fit()
    return read_metrics(tmp_path)


def diagnosis(caplog) -> str:
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("doctor: ")]
    assert lines, "no diagnosis was logged"
    return lines[-1]


def test_a_slow_disk_is_named_read_bound_with_more_workers_or_a_faster_disk(tiny_dataset, tmp_path, caplog):
    record = run(tiny_dataset, tmp_path, caplog, "dataset._target_=tests.test_doctor.SlowReads")[-1]
    assert record["bound"] == "read/fetch", diagnosis(caplog)
    assert max(("read", "decode", "augment"), key=lambda s: record[f"{s}_share"]) == "read"
    assert "faster disk" in diagnosis(caplog)
    assert "where a sample's time went" in caplog.text


@pytest.mark.slow
def test_a_costly_augment_step_is_named_augment_bound_with_a_cheaper_recipe(tiny_dataset, tmp_path, caplog):
    record = run(tiny_dataset, tmp_path, caplog, "augment._target_=tests.test_doctor.BurningRecipe")[-1]
    assert record["bound"] == "augment", diagnosis(caplog)
    assert "cheaper recipe" in diagnosis(caplog)


def test_a_model_that_dominates_is_named_compute_bound(tiny_dataset, tmp_path, caplog):
    record = run(tiny_dataset, tmp_path, caplog, "model._target_=tests.test_doctor.SlowNet")[-1]
    assert record["bound"] == "compute", diagnosis(caplog)
    assert record["compute_share"] > 0.5
    assert sum(record[f"{s}_share"] for s in ("read", "decode", "augment", "collate", "handoff", "copy", "wait",
                                              "compute")) == pytest.approx(1.0)


def test_a_read_and_decode_in_one_call_are_split_by_the_cpu_share_of_the_calls_that_read_it():
    """The clock reads the thread's CPU time on one call in SPLIT_EVERY and gives the others the CPU time the measured
    ones took: calls that wait are read, calls that burn CPU (a few batches on) decode, and no time is lost."""
    clock = StageClock()

    def batch(work) -> tuple[float, float]:
        walls = 0
        for _ in range(2 * SPLIT_EVERY):
            began = time.perf_counter_ns()
            clock.start()
            work()
            clock.split(READ, DECODE)
            walls += time.perf_counter_ns() - began
        sums = clock.take()
        assert sums[READ] + sums[DECODE] == pytest.approx(walls, rel=0.05)
        return sums[READ] / walls, sums[DECODE] / walls

    waiting = batch(lambda: time.sleep(0.001))
    burning = [batch(lambda: _burn(0.001)) for _ in range(4)][-1]
    # a sleep uses no CPU however loaded the machine; a burn's share of the wall is its share of a core
    assert waiting[1] < 0.2 and burning[1] > 2 * waiting[1] + 0.05, (waiting, burning)


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
