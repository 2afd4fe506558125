"""data.autotune (train/data/loader/autotune.py): with real workers and real JPEG files, a decode-bound run started
without workers gets one by its second epoch, says so in one line and trains the very samples a run without autotune
trains; a resume keeps the choice; a compute-bound run changes nothing; memory near its limit takes a worker away."""

from __future__ import annotations

import json
import logging
import time

import torch

from tests.conftest import compose_config, read_metrics
from tests.sample_log import SampleLog
from tests.tiny_net import TinyNet
from train.data import data_from_config
from train.data.datasets import ImageFolderDataset
from train.data.loader.autotune import decide
from train.data.loader.plan import LoaderPlan
from train.dist import DistEnv, seed_everything
from train.loop import checkpoint
from train.loop.engine import Trainer
from train.loop.model import build_model
from train.observe.doctor import Finding

CPU = torch.device("cpu")


class SlowDecode(ImageFolderDataset):
    """JPEGs that take 4 ms of CPU more to decode."""

    def __getitem__(self, index: int):
        end = time.thread_time() + 0.004
        while time.thread_time() < end:
            pass
        return super().__getitem__(index)


class SlowNet(TinyNet):
    """A model that dominates: 500 ms a forward."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        time.sleep(0.5)
        return super().forward(images)


def trainer(tiny_dataset, run_dir, *overrides: str) -> tuple[Trainer, object]:
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "data.num_workers=0", "data.prefetch_factor=1", "data.autotune=true", "trainer.epochs=3",
                          "trainer.limit_batches=6",
                          "trainer.progress=false", "logger=[]", "model._target_=tests.tiny_net.TinyNet",
                          "dataset._target_=tests.test_autotune.SlowDecode", *overrides])
    data = data_from_config(cfg, DistEnv(), CPU)
    seed_everything(cfg.trainer.seed, DistEnv())  # the same initial weights in every run
    return Trainer.from_config(cfg, DistEnv(), CPU, data, build_model(cfg.model, data.num_classes, CPU), run_dir,
                               callbacks=[SampleLog()]), data


def fit(tiny_dataset, run_dir, caplog, *overrides: str) -> tuple[list[str], list[dict]]:
    """The autotune lines and the doctor's stage tables, in order, and the metrics of a whole run."""
    fitted, data = trainer(tiny_dataset, run_dir, *overrides)
    with caplog.at_level(logging.INFO), data:
        fitted.fit()
    lines = [r.getMessage().split(":\n")[0] for r in caplog.records
             if r.getMessage().startswith(("autotune: ", "where a sample's time went"))]
    caplog.clear()
    return lines, read_metrics(run_dir)


def trained(run_dir) -> list:
    return [json.loads(path.read_text())["batches"] for path in sorted((run_dir / "samples").glob("epoch*.json"))]


def test_a_decode_bound_run_gets_a_worker_by_epoch_two_and_trains_the_same_samples(tiny_dataset, tmp_path, caplog):
    lines, records = fit(tiny_dataset, tmp_path / "tuned", caplog)
    # the decode burns CPU; on a loaded machine the wall time around it can count as the read instead
    assert records[0]["bound"] in ("decode", "read/fetch"), records[0]
    assert lines[:3] == ["where a sample's time went (0 workers)",
                         f"autotune: data.num_workers 0 -> 1 ({records[0]['bound']}-bound, a core free)",
                         "where a sample's time went (1 workers)"], lines  # epoch 2 ran with the worker
    assert not [line for line in fit(tiny_dataset, tmp_path / "static", caplog, "data.autotune=false")[0]
                if line.startswith("autotune")]
    assert trained(tmp_path / "tuned") == trained(tmp_path / "static")  # the same (epoch, index) sequence
    static = read_metrics(tmp_path / "static")
    assert [r["train_loss"] for r in records] == [r["train_loss"] for r in static]  # the same pixels too


def test_a_resume_keeps_the_chosen_workers(tiny_dataset, tmp_path, caplog):
    run_dir = tmp_path / "run"
    fit(tiny_dataset, run_dir, caplog, "trainer.epochs=2")
    assert checkpoint.load(checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST)["autotune"]["num_workers"] == 1
    resumed, data = trainer(tiny_dataset, run_dir)
    with data:
        resumed.resume(checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST)
        assert data.plan.num_workers == 1 and data.train.loader.num_workers == 1
        assert resumed.fit()[0]["epoch"] == 3


def test_a_compute_bound_run_changes_nothing(tiny_dataset, tmp_path, caplog):
    lines, records = fit(tiny_dataset, tmp_path, caplog, "model._target_=tests.test_autotune.SlowNet",
                         "dataset._target_=train.data.datasets.ImageFolderDataset", "trainer.limit_batches=3",
                         "trainer.epochs=2")
    assert records[0]["bound"] in ("compute", "keeps up"), records[0]
    assert not [line for line in lines if line.startswith("autotune")]


def test_memory_near_its_limit_takes_a_worker_away_and_blocks_growth():
    plan = LoaderPlan(num_workers=2, batch_size=16, prefetch_factor=2, pin_memory=False, image_size=32,
                      dtype=torch.uint8)
    starved = Finding("decode", "workers", wait_frac=0.8, worker_s=0.01, step_s=0.001)
    backed_off = decide(starved, plan, cap=4, pressure="100 MiB of 8192 MiB RAM free", extra_bytes=1)
    assert backed_off.num_workers == 1 and "memory" in backed_off.why
    assert decide(starved, plan, cap=4, pressure=None, extra_bytes=1).num_workers == 4
    assert decide(Finding("compute", "workers", 0.01, 0.01, 0.1), plan, cap=4, pressure=None, extra_bytes=1) is None
