"""The loader explains itself (loadout/observe/doctor.py, loadout/data/loader/stages.py): each bottleneck, injected from
outside with real workers and real JPEG files, is named by the epoch's diagnosis, and its stage leads the stage
shares."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from loadout.data.datasets import ImageFolderDataset
from loadout.data.loader.stages import DECODE, READ, SPLIT_EVERY, StageClock
from loadout.data.transforms import DirectCompose
from loadout.dist import DistEnv
from loadout.observe.doctor import STAGES
from tests.conftest import compose_config, read_metrics, trainer_for
from tests.tiny_net import TinyNet
from train.augment import Recipe
from train.job import data_from_config

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread_steps")  # the diagnoses compare the loader's pace to the step's


# The injected costs are sleeps of 50 ms a sample, many times what a loaded 2-core box takes for anything else a
# sample costs (TinyNet's step ~1 ms a sample there, on one thread): a sleep takes as long on a busy machine, so load
# cannot close the gap. trainer.limit_batches keeps the epochs short.
SLOW = 0.05


class SlowReads(ImageFolderDataset):
    """A folder on a slow disk: every read waits before the file comes."""

    def read_encoded(self, index: int) -> tuple[bytes, int]:
        time.sleep(SLOW)
        return super().read_encoded(index)


class Costly:
    """A costly augment step (the stage is timed by the wall, so a sleep costs what a burn of the CPU would)."""

    def __call__(self, image):
        time.sleep(SLOW)
        return image


class CostlyRecipe(Recipe):
    def train_transform(self, data_cfg, input_size=None):
        return DirectCompose([Costly(), *super().train_transform(data_cfg, input_size).transforms])


class SlowNet(TinyNet):
    """A model that dominates on any machine, however loaded: 1 s a training forward (62 ms a sample of 16), where
    a loaded 2-core box feeds a sample in ~1 ms and spends ~10 ms a batch handing it over (the loop's wait); at 500 ms
    a loaded box's one slow batch (0.36 s) was 11 % of an epoch. Asleep, not burning: a busy machine does not shrink
    the gap."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(1.0)
        return super().forward(images)


def run(tiny_dataset, tmp_path, caplog, *overrides: str) -> list[dict]:
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "data.num_workers=1", "trainer.epochs=1", "trainer.progress=false", "logger=[]",
                          "model._target_=tests.tiny_net.TinyNet", *overrides])
    with caplog.at_level(logging.INFO, logger="loadout.observe.doctor"), data_from_config(cfg, DistEnv(), CPU) as data:
        trainer = trainer_for(cfg, data, tmp_path)
        trainer.fit()
    return read_metrics(tmp_path)


def diagnosis(caplog) -> str:
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("doctor: ")]
    assert lines, "no diagnosis was logged"
    return lines[-1]


def test_a_slow_disk_is_named_read_bound_with_more_workers_or_a_faster_disk(tiny_dataset, tmp_path, caplog):
    record = run(tiny_dataset, tmp_path, caplog, "dataset._target_=tests.test_doctor.SlowReads",
                 "trainer.limit_batches=2")[-1]
    assert record["bound"] == "read/fetch", diagnosis(caplog)
    assert max(("read", "decode", "augment"), key=lambda s: record[f"{s}_share"]) == "read"
    assert "faster disk" in diagnosis(caplog)
    assert "where a sample's time went" in caplog.text


@pytest.mark.slow
def test_a_costly_augment_step_is_named_augment_bound_with_a_cheaper_recipe(tiny_dataset, tmp_path, caplog):
    record = run(tiny_dataset, tmp_path, caplog, "augment._target_=tests.test_doctor.CostlyRecipe",
                 "trainer.limit_batches=3")[-1]
    assert record["bound"] == "augment", diagnosis(caplog)
    assert "cheaper recipe" in diagnosis(caplog)


def test_a_model_that_dominates_is_named_compute_bound(tiny_dataset, tmp_path, caplog):
    # the second epoch of persistent workers: the first batch's wait for a starting worker (0.5 s on a loaded box,
    # over the 10% of an epoch that makes the loader the bound) is not the loader's pace
    record = run(tiny_dataset, tmp_path, caplog, "model._target_=tests.test_doctor.SlowNet", "trainer.epochs=2",
                 "trainer.limit_batches=6", "data.persistent_workers=true")[-1]
    assert record["epoch"] == 2
    assert record["bound"] == "compute", diagnosis(caplog)
    assert max(STAGES, key=lambda s: record[f"{s}_share"]) == "compute"
    assert sum(record[f"{s}_share"] for s in STAGES) == pytest.approx(1.0)


def test_a_read_and_decode_in_one_call_are_split_by_the_cpu_share_of_the_calls_that_read_it():
    """The clock reads the thread's CPU time on one call in SPLIT_EVERY and gives the others the CPU time the measured
    ones took: calls that wait are read, calls that burn CPU (a few batches on) decode, and no time is lost. Judged by
    CPU time, which load does not stretch: a loaded machine stretches the wall, so shares of the wall would depend
    on it."""
    clock = StageClock()
    calls = 2 * SPLIT_EVERY

    def batch(work, seconds: float) -> tuple[float, float]:
        walls = 0
        for _ in range(calls):
            began = time.perf_counter_ns()
            clock.start()
            work()
            clock.split(READ, DECODE)
            walls += time.perf_counter_ns() - began
        sums = clock.take()
        # all of each call's wall, no more (the walls measured around the calls also hold the clock's own reads)
        assert calls * seconds * 1e9 <= sums[READ] + sums[DECODE] <= walls
        return sums[READ], sums[DECODE]

    # a sleep of 10 ms uses next to no CPU (a loaded box adds ~0.1 ms of it a call: far under 10 %); a burn at least
    # its 1 ms a call, of which the moving mean has 90% four batches on
    waiting = batch(lambda: time.sleep(0.01), 0.01)
    burning = [batch(lambda: _burn(0.001), 0.001) for _ in range(4)][-1]
    assert waiting[1] < 0.1 * calls * 1e7 and waiting[0] > calls * 1e7 * 0.9, waiting
    assert burning[1] > 0.8 * calls * 1e6, burning


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
