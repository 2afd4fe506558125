"""data.autotune (loadout/data/loader/autotune.py): with real workers and real JPEG files, a decode-bound run started
without workers gets them by its second epoch, or within its first when that epoch is long, says so in one line and
trains the very samples a run without autotune trains; a resume keeps the choice; a compute-bound run changes
nothing; memory near its limit takes a worker away; a change goes straight to the worker count the pace asks."""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import replace

import pytest
import torch

from loadout.data.datasets import ImageFolderDataset
from loadout.data.loader.autotune import cores_free, decide, kept_cores
from loadout.data.loader.plan import LoaderPlan
from loadout.dist import DistEnv, seed_everything
from loadout.observe.doctor import Finding
from loadout.runtime import checkpoint
from tests.conftest import compose_config, read_metrics, trainer_for
from tests.sample_log import SampleLog
from tests.tiny_net import TinyNet
from train.job import data_from_config
from train.loop.engine import Trainer

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread_steps")  # the decisions compare the loader's pace to the step's


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
    return trainer_for(cfg, data, run_dir, callbacks=[SampleLog()]), data


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


@pytest.mark.slow
def test_a_decode_bound_run_gets_its_workers_by_epoch_two_and_trains_the_same_samples(tiny_dataset, tmp_path, caplog):
    lines, records = fit(tiny_dataset, tmp_path / "tuned", caplog)
    # the decode burns CPU; on a loaded machine the wall time around it can count as the read instead
    assert records[0]["bound"] in ("decode", "read/fetch"), records[0]
    # the step is tiny: what the main process keeps once workers load the samples leaves every core to them
    change = re.fullmatch(rf"autotune: data.num_workers 0 -> (\d+), data.prefetch_factor 1 -> 2 \({records[0]['bound']}"
                          r"-bound, (a core|\d+ cores) free\)", lines[1] if len(lines) > 1 else "")
    assert change and lines[0] == "where a sample's time went (0 workers)", lines
    assert lines[2] == f"where a sample's time went ({change[1]} workers)", lines  # epoch 2 ran with them
    assert not [line for line in fit(tiny_dataset, tmp_path / "static", caplog, "data.autotune=false")[0]
                if line.startswith("autotune")]
    assert trained(tmp_path / "tuned") == trained(tmp_path / "static")  # the same (epoch, index) sequence
    static = read_metrics(tmp_path / "static")
    assert [r["train_loss"] for r in records] == [r["train_loss"] for r in static]  # the same pixels too


@pytest.mark.slow
def test_a_resume_keeps_the_chosen_workers(tiny_dataset, tmp_path, caplog):
    run_dir = tmp_path / "run"
    fit(tiny_dataset, run_dir, caplog, "trainer.epochs=2")
    chosen = checkpoint.load(checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST)["autotune"]["num_workers"]
    assert chosen >= 1
    resumed, data = trainer(tiny_dataset, run_dir)
    with data:
        resumed.resume(checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST)
        assert data.plan.num_workers == chosen and data.train.loader.num_workers == chosen
        assert resumed.fit()[0]["epoch"] == 3


def test_a_compute_bound_run_changes_nothing(tiny_dataset, tmp_path, caplog):
    lines, records = fit(tiny_dataset, tmp_path, caplog, "model._target_=tests.test_autotune.SlowNet",
                         "dataset._target_=loadout.data.datasets.ImageFolderDataset", "trainer.limit_batches=3",
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


@pytest.mark.slow
def test_a_long_first_epoch_gets_its_workers_within_the_epoch_and_trains_the_same_samples(tiny_dataset, tmp_path,
                                                                                          caplog):
    """240 samples in batches of 2: 120 batches, long enough to measure a window and change at a batch boundary."""
    long = ("data.batch_size=2", "trainer.limit_batches=null", "trainer.epochs=2")
    lines, records = fit(tiny_dataset, tmp_path / "tuned", caplog, *long)
    assert len(lines) == 3 and lines[0].startswith("autotune: data.num_workers 0 -> "), lines
    workers = int(lines[0].split(" -> ")[1].split(",")[0])
    assert workers >= 1 and lines[0].startswith(f"autotune: data.num_workers 0 -> {workers}, data.prefetch_factor "
                                                "1 -> 2 ("), lines
    assert lines[1:] == [f"where a sample's time went ({workers} workers)"] * 2, lines  # the change came in epoch 1
    static_lines, static = fit(tiny_dataset, tmp_path / "static", caplog, *long, "data.autotune=false")
    assert not [line for line in static_lines if line.startswith("autotune")]
    assert trained(tmp_path / "tuned") == trained(tmp_path / "static")  # the same (epoch, index) sequence
    assert [r["train_loss"] for r in records] == [r["train_loss"] for r in static]  # the same pixels too


def test_a_replan_converts_its_batches_on_one_thread_beside_workers_and_on_all_without(tiny_dataset):
    cfg = compose_config(["hardware=cpu", f"data.root={tiny_dataset}", "data.image_size=32", "data.batch_size=16",
                          "data.num_workers=0", "data.prefetch_factor=1"])
    with data_from_config(cfg, DistEnv(), CPU) as data:
        def one_thread() -> list[bool]:
            return [data.val.one_thread, data.train.to_device([]).one_thread]

        assert one_thread() == [False, False]  # the main process loads the samples: every thread converts
        data.replan(replace(data.plan, num_workers=1, prefetch_factor=2))
        assert one_thread() == [True, True]  # the workers hold the cores: one thread converts, the model keeps its
        data.replan(replace(data.plan, num_workers=0, prefetch_factor=1))
        assert one_thread() == [False, False]


PLAN = LoaderPlan(num_workers=0, batch_size=16, prefetch_factor=1, pin_memory=False, image_size=32, dtype=torch.uint8)


def test_a_change_goes_straight_to_the_workers_the_pace_asks_with_two_batches_in_flight_each():
    slow_decode = Finding("decode", "workers", wait_frac=0.7, worker_s=0.012, step_s=0.004)  # 3 workers keep pace
    change = decide(slow_decode, PLAN, cap=6, pressure=None, extra_bytes=1)
    assert (change.num_workers, change.prefetch_factor) == (3, 2)
    assert decide(slow_decode, PLAN, cap=2, pressure=None, extra_bytes=1).num_workers == 2  # the cores' share


def test_the_cores_free_are_those_the_main_process_leaves_never_fewer_than_the_share():
    assert cores_free(1, 2.0, None) == 1  # not measured yet: 3/4 of the cores
    assert cores_free(1, 2.0, 1.1) == 1  # a main process using 1.1 cores beside its workers holds one
    assert cores_free(1, 2.0, 0.3) == 2  # one that mostly waits for its worker leaves its core to a second
    assert cores_free(1, 2.0, 0.7) == 2 and cores_free(1, 2.0, 0.8) == 1  # a quarter of a core left counts
    assert cores_free(6, 8.0, 4.0) == 6  # a main process busy with its step never costs the share


def test_a_main_process_loading_its_own_samples_is_judged_by_what_it_keeps_once_workers_load_them():
    decode_bound = Finding("decode", "workers", wait_frac=0.9, worker_s=0.009, step_s=0.0005, sample_s=0.010)
    assert kept_cores(decode_bound, 2.0) == pytest.approx(0.2)  # 1 ms kept of a 5 ms pace: 2 workers at once
    assert cores_free(1, 2.0, kept_cores(decode_bound, 2.0)) == 2
    compute_bound = Finding("compute", "workers", wait_frac=0.1, worker_s=0.001, step_s=0.009, sample_s=0.010)
    assert cores_free(1, 2.0, kept_cores(compute_bound, 2.0)) == 1  # its step holds the core


def test_at_the_cores_share_a_deeper_prefetch_only_where_the_workers_keep_the_pace_on_average():
    at_cap = LoaderPlan(num_workers=2, batch_size=16, prefetch_factor=2, pin_memory=False, image_size=32,
                        dtype=torch.uint8)
    jitter = Finding("read/fetch", "workers", wait_frac=0.3, worker_s=0.006, step_s=0.004)  # 2 workers: 3 ms each
    assert decide(jitter, at_cap, cap=2, pressure=None, extra_bytes=1).prefetch_factor == 4
    barely = replace(jitter, wait_frac=0.15)  # a wait too short to be worth restarting the workers for
    assert decide(barely, at_cap, cap=2, pressure=None, extra_bytes=1) is None
    too_slow = Finding("decode", "workers", wait_frac=0.6, worker_s=0.02, step_s=0.004)  # 5 workers would keep pace
    assert decide(too_slow, at_cap, cap=2, pressure=None, extra_bytes=1) is None  # a restart for nothing


def test_a_change_that_made_samples_slower_is_undone_and_the_plan_stays(tiny_dataset, tmp_path, caplog):
    """The diagnosis asks for a worker; the next epoch on it is measured slower a sample: back to no workers, and a
    later epoch's same diagnosis changes nothing (a resume keeps that)."""
    from loadout.data.loader.autotune import Autotune

    caplog.set_level(logging.INFO, logger="loadout.data.loader.autotune")
    _, data = trainer(tiny_dataset, tmp_path)
    with data:
        tuner = Autotune(data, DistEnv(), cores=4)
        starved = Finding("decode", "workers", wait_frac=0.8, worker_s=0.004, step_s=0.001, sample_s=0.005)
        assert tuner.after_epoch(starved).num_workers >= 1 and data.plan.num_workers >= 1
        resumed = Autotune(data, DistEnv(), cores=4)  # a checkpoint between the change and its measurement
        resumed.load_state_dict(tuner.state_dict())
        tuner = resumed
        undone = tuner.after_epoch(replace(starved, sample_s=0.008))
        assert (undone.num_workers, data.plan.num_workers) == (0, 0) and "undone" in undone.why
        assert tuner.after_epoch(starved) is None and data.plan.num_workers == 0
        again = Autotune(data, DistEnv(), cores=4)
        again.load_state_dict(tuner.state_dict())
        assert again.after_epoch(starved) is None
        kept = Autotune(data, DistEnv(), cores=4)  # a change as fast as before stays, and the tuning goes on
        assert kept.after_epoch(starved).num_workers >= 1
        kept.after_epoch(replace(starved, sample_s=0.0051))
        assert not kept.settled and data.plan.num_workers >= 1
    assert any("undone" in record.getMessage() for record in caplog.records)
