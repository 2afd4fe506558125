"""task=segmentation through the fault paths, for real: two gloo ranks under torchrun whose mIoU and pixel accuracy
(a confusion matrix summed over the ranks) are those of one process evaluating the same checkpoint, and a SIGTERM
mid-epoch whose resumed run trains, scores and logs exactly what an uninterrupted one does (the same pixels and masks
for (seed, epoch, index); the resumed epoch's training figures cover the whole epoch). Real JPEG images and
palette-PNG masks, real DataLoader workers, real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from scripts.make_dataset import make_synthetic_voc
from tests.conftest import RECORD_SAMPLES, ROOT, epoch_samples, read_metrics, run_cli, training_at, wait_for
from tests.test_distributed import ok, only_run_dir, torchrun
from tests.test_preemption import assert_same_weights, last_checkpoint

TRAIN, VAL, BATCH = 96, 13, 8  # 12 steps an epoch in one process; 13 val images split 7 / 6 over two ranks
EPOCHS = 2
FIGURES = ("val_loss", "val_miou", "val_pixel_acc", "val_samples")
TRAIN_FIGURES = ("train_loss", "grad_norm", "lr", "images", "bad_samples", "skipped_steps")  # sums, means, counts


class TinySegNet(nn.Module):
    """A per-pixel classifier small enough to train an epoch in a second (`model._target_`), with BatchNorm."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, num_classes, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)


class RankFigures:
    """A callback the test installs: every rank writes the figures its evaluation reported, per epoch."""

    def on_epoch_end(self, trainer, record: dict) -> None:
        path = trainer.run_dir / "figures" / f"epoch{record['epoch']}_rank{trainer.env.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({key: record[key] for key in FIGURES}))


class Paced:
    """A callback the test installs: a training batch takes at least 0.15 s, so a signal sent at a batch lands
    within the epoch on an idle machine too (an epoch of this net otherwise takes 0.1 s)."""

    def on_train_batch(self, trainer, batch) -> None:
        time.sleep(0.15)


@pytest.fixture(scope="module")
def voc(tmp_path_factory) -> Path:
    return make_synthetic_voc(tmp_path_factory.mktemp("voc"), train=TRAIN, val=VAL, size=40)


def seg_args(root: Path, *extra: str) -> list[str]:
    return ["hardware=cpu", "task=segmentation", f"data.root={root}", "data.image_size=32",
            f"data.batch_size={BATCH}", "model._target_=tests.test_segmentation_faults.TinySegNet", "~model.name",
            "trainer.precision=fp32", "trainer.deterministic=true", "trainer.progress=false", *extra]


@pytest.mark.slow  # torchrun's two ranks, then a one-process validation: ~40 s on 2 loaded cores
def test_two_ranks_report_the_figures_of_one_process_evaluating_the_same_checkpoint(voc, tmp_path):
    cwd = tmp_path / "ddp"
    cwd.mkdir()
    ok(torchrun(seg_args(voc, "trainer.epochs=1", "data.num_workers=1",
                         "+callbacks.figures._target_=tests.test_segmentation_faults.RankFigures"), cwd))
    run_dir = only_run_dir(cwd)
    ranks = [json.loads((run_dir / "figures" / f"epoch1_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1]  # one all-reduced confusion matrix: the same figures on every rank
    assert ranks[0]["val_samples"] == VAL and 0 < ranks[0]["val_pixel_acc"] <= 1

    alone = tmp_path / "validate"
    done = run_cli(seg_args(voc, "data.num_workers=0", "trainer.mode=validate",
                            f"trainer.resume={run_dir / 'checkpoints' / 'last.pt'}", f"hydra.run.dir={alone}"))
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = read_metrics(alone)
    assert record["val_samples"] == VAL
    # the confusion matrix's counts are exact; (val_loss weighs each batch's mean by its images: batching shows)
    assert (record["val_miou"], record["val_pixel_acc"]) == (ranks[0]["val_miou"], ranks[0]["val_pixel_acc"])


@pytest.fixture(scope="module")
def reference(voc, tmp_path_factory) -> Path:
    """An uninterrupted 2-epoch segmentation run with 2 workers."""
    run_dir = tmp_path_factory.mktemp("seg-reference") / "run"
    done = run_cli(seg_args(voc, f"trainer.epochs={EPOCHS}", "data.num_workers=2", RECORD_SAMPLES,
                            f"hydra.run.dir={run_dir}"))
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.slow  # three short training runs: ~45 s on 2 loaded cores
def test_sigterm_mid_epoch_then_resume_trains_and_scores_exactly_as_an_uninterrupted_run(voc, reference, tmp_path):
    run_dir = tmp_path / "run"
    args = seg_args(voc, f"trainer.epochs={EPOCHS}", "data.num_workers=2", RECORD_SAMPLES, f"hydra.run.dir={run_dir}",
                    "+callbacks.pace._target_=tests.test_segmentation_faults.Paced")
    proc = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: training_at(run_dir) >= (1, 3), 300, "epoch 2 to be under way")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out[-3000:]  # resumable
    stopped = re.search(r"stopped by SIGTERM at epoch 2, batch (\d+); continue with: \S*python\S* -m train (.*)$",
                        out, re.MULTILINE)
    assert stopped, out[-3000:]
    assert 0 < int(stopped[1]) < TRAIN // BATCH  # mid-epoch
    assert last_checkpoint(run_dir)["progress"]["batch_in_epoch"] == int(stopped[1])

    resumed = run_cli(stopped[2].split(), cwd=tmp_path)  # the line's command, pasted in the same directory
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for epoch in range(EPOCHS):  # the same samples in the same order: with their seeds, the same pixels and masks
        assert epoch_samples(run_dir, epoch, 0) == epoch_samples(reference, epoch, 0), epoch
    assert_same_weights(run_dir, reference)
    got, want = read_metrics(run_dir), read_metrics(reference)
    assert [r["epoch"] for r in got] == [r["epoch"] for r in want] == [1, 2]
    for mine, theirs in zip(got, want, strict=True):  # every figure of every epoch, exactly, the resumed one's too
        keys = (*FIGURES, *TRAIN_FIGURES)
        assert {key: mine[key] for key in keys} == {key: theirs[key] for key in keys}, mine["epoch"]
    assert got[1]["images"] == TRAIN
