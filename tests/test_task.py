"""The task seam (train/task/): each task's loss and evaluation figures on tensors made here, the reduction of a
segmentation confusion matrix over two real gloo ranks, the vocabulary a task adds its figures to, the best rule and
an old checkpoint's best, and a source checked for what its task needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from loadout.data.loader.batch import Batch
from loadout.data.masks import decode_mask
from loadout.data.source import check_sources
from loadout.dist import DistEnv
from loadout.errors import ConfigError
from loadout.observe.metrics import EPOCH, epoch_line
from loadout.runtime import checkpoint
from scripts.make_dataset import make_synthetic_voc
from tests.conftest import ROOT, compose_config, read_metrics, run_cli
from train.loop.evaluate import Evaluation
from train.loop.progress import Progress
from train.loop.step import TrainStep
from train.task import Classification, build_task
from train.task.segmentation import Segmentation, scores

CPU = torch.device("cpu")
# rows: true class, columns: predicted
CONFUSION = np.array([[5, 1, 0],
                      [2, 3, 0],
                      [0, 0, 0]])
# IoU 5 / (5 + 1 + 2) and 3 / (3 + 2 + 1); class 2 occurs nowhere and is left out of the mean
MIOU, PIXEL_ACC = (5 / 8 + 3 / 6) / 2, 8 / 11


def test_miou_and_pixel_accuracy_of_a_known_confusion_matrix():
    assert scores(CONFUSION) == pytest.approx({"val_miou": MIOU, "val_pixel_acc": PIXEL_ACC})
    assert scores(np.zeros((3, 3))) == {"val_miou": 0.0, "val_pixel_acc": 0.0}


def one_hot_logits(predicted: torch.Tensor, classes: int) -> torch.Tensor:
    """(N, H, W) predictions as (N, C, H, W) logits whose argmax they are."""
    return torch.nn.functional.one_hot(predicted.long(), classes).permute(0, 3, 1, 2).float() * 10


def pixels_of(confusion: np.ndarray, ignored: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One (1, 1, W) mask and prediction whose pixels make `confusion`, plus `ignored` pixels of 255 (predicted 0)."""
    true, predicted = [], []
    for t, p in np.ndindex(*confusion.shape):
        true += [t] * int(confusion[t, p])
        predicted += [p] * int(confusion[t, p])
    true, predicted = true + [255] * ignored, predicted + [0] * ignored
    return torch.tensor(true, dtype=torch.uint8).view(1, 1, -1), torch.tensor(predicted).view(1, 1, -1)


def test_segmentation_counts_a_confusion_matrix_leaving_ignored_pixels_out():
    task = Segmentation(num_classes=3)
    targets, predicted = pixels_of(CONFUSION, ignored=4)
    outputs = {"out": one_hot_logits(predicted, 3)}  # as torchvision's segmentation models return them
    sums = task.eval_sums(outputs, targets)
    assert sums.dtype == torch.float64 and sums.shape == (1 + 9,)
    assert sums[1:].view(3, 3).long().tolist() == CONFUSION.tolist()
    figures = task.evaluation(sums.tolist(), samples=1)
    assert figures["val_miou"] == pytest.approx(MIOU) and figures["val_pixel_acc"] == pytest.approx(PIXEL_ACC)
    # the loss skips the ignored pixels: the same as over the scored pixels alone
    scored = targets != 255
    expected = torch.nn.functional.cross_entropy(outputs["out"].permute(0, 2, 3, 1)[scored], targets[scored].long())
    assert task.loss(outputs, targets).item() == pytest.approx(expected.item())


def test_a_slice_of_ignored_pixels_alone_has_a_zero_loss_not_nan():
    """A crop that lands on VOC's border alone (every pixel 255): 0 with zero gradients, not a NaN mean of nothing
    that stops the run as diverged."""
    logits = torch.randn(2, 3, 4, 4, requires_grad=True)
    loss = Segmentation(num_classes=3).loss({"out": logits}, torch.full((2, 4, 4), 255, dtype=torch.uint8))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


def test_the_loss_and_the_confusion_matrix_never_wait_for_the_device():
    """On the meta device (no values) any step whose output shape depends on the pixels (a boolean-mask index,
    bincount: a host sync on CUDA) raises; both run there."""
    task = Segmentation(num_classes=3)
    logits = torch.empty(2, 3, 8, 8, device="meta")
    targets = torch.empty(2, 8, 8, dtype=torch.uint8, device="meta")
    assert task.loss({"out": logits}, targets).shape == ()
    assert task.eval_sums({"out": logits}, targets).shape == (1 + 9,)


def test_classification_sums_loss_top1_and_top5_with_label_smoothing():
    task = Classification(label_smoothing=0.1)
    logits = torch.tensor([[3.0, 2, 1, 0, -1, -2], [0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]])
    targets = torch.tensor([0, 0, 4])  # right; in the top five of none (6 classes, 0 is last); in the top five
    sums = task.eval_sums(logits, targets).tolist()
    expected = torch.nn.functional.cross_entropy(logits, targets, label_smoothing=0.1).item() * 3
    assert sums == pytest.approx([expected, 1, 2])
    assert task.evaluation(sums, 3) == pytest.approx({"val_loss": expected / 3, "val_acc": 1 / 3, "val_top5": 2 / 3})


def test_each_task_knows_how_many_counts_it_sums():
    """Evaluation trusts `num_counts` for the width of the one reduction: it must be eval_counts' length."""
    logits = torch.randn(2, 3, 4, 4)
    segmentation = Segmentation(num_classes=3)
    assert segmentation.num_counts() == len(segmentation.eval_counts(logits, torch.zeros(2, 4, 4, dtype=torch.uint8)))
    classification = Classification()
    assert classification.num_counts() == len(classification.eval_counts(logits[:, :, 0, 0], torch.tensor([0, 2])))


def test_no_validation_sample_gives_zeros_of_every_figure():
    cfg = compose_config(["hardware=cpu"])
    step = TrainStep.from_config(cfg, DistEnv(), CPU, torch.nn.Linear(3, 4), 1, task=build_task(cfg))
    assert evaluation(step)([Batch(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))]) == \
        {"val_loss": 0.0, "val_acc": 0.0, "val_top5": 0.0, "val_samples": 0}


def test_a_task_without_num_counts_fails_in_one_line_before_training(tmp_path, monkeypatch):
    (tmp_path / "partial_task.py").write_text(
        "from train.task import Task\n\n"
        "class Partial(Task):\n"
        "    def loss(self, outputs, targets): ...\n"
        "    def eval_counts(self, outputs, targets): ...\n"
        "    def figures_of(self, counts, samples): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^task._target_=partial_task.Partial: define num_counts \(train/task/"):
        build_task(compose_config(["task._target_=partial_task.Partial", "~task.label_smoothing"]))


def test_a_task_puts_its_figures_in_the_vocabulary_after_val_loss_and_back():
    try:
        build_task(compose_config(["task=segmentation"]))
        assert "val_miou" in EPOCH and "val_acc" not in EPOCH
        keys = list(EPOCH)
        assert keys[keys.index("val_loss") + 1:keys.index("val_loss") + 3] == ["val_miou", "val_pixel_acc"]
        line = epoch_line({"epoch": 1, "val_loss": 0.5, "val_miou": 0.25, "val_pixel_acc": 0.75}, 3)
        assert line == "epoch 1/3  val_loss 0.5000  miou 0.250  pixel_acc 0.750"
    finally:
        task = build_task(compose_config([]))
    assert isinstance(task, Classification) and list(EPOCH)[3:5] == ["val_acc", "val_top5"]


def test_the_best_rule_follows_the_tasks_figure_and_direction():
    assert Classification().best == ("val_acc", "max") and Segmentation().best == ("val_miou", "max")
    task = Classification()
    assert task.better(0.0, None) and task.better(0.5, 0.4) and not task.better(0.4, 0.4)
    assert not task.better(float("nan"), None)
    lowest = Classification()
    lowest.best = ("val_loss", "min")
    assert lowest.better(0.3, 0.4) and not lowest.better(0.5, 0.4)


def test_an_old_checkpoints_best_val_acc_becomes_the_best(tmp_path):
    path = tmp_path / "last.pt"
    for old_best, best in ((0.625, 0.625), (-1.0, None)):  # -1: none yet
        old = {"epoch": 2, "step": 30, "batch_in_epoch": 0, "best_val_acc": old_best}
        torch.save({"format": checkpoint.FORMAT, "progress": old}, path)
        assert Progress.from_state(checkpoint.load(path)["progress"]) == Progress(epoch=2, step=30, best=best)
    assert Progress.from_state(Progress(best=0.5).state_dict()).best == 0.5


def test_the_old_label_smoothing_key_names_the_new_one():
    from loadout.run.overrides import check_command_line
    from train.config import SCHEMA

    with pytest.raises(ConfigError, match=r"^trainer.label_smoothing: .*task.label_smoothing"):
        check_command_line(["trainer.label_smoothing=0.1"], SCHEMA)
    assert check_command_line(["task.label_smoothing=0.1"], SCHEMA).task.label_smoothing == 0.1


class Masks:
    classes = ["background", "square"]

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int):
        return torch.zeros(3, 8, 8, dtype=torch.uint8), torch.zeros(8, 8, dtype=torch.uint8)


def test_a_source_is_checked_for_what_its_task_needs():
    check_sources("Masks", Masks(), Masks(), Segmentation())
    with pytest.raises(ConfigError, match=r"dataset\[0\] must be \(image, label\).*an integer label"):
        check_sources("Masks", Masks(), Masks(), Classification())
    no_classes = type("NoClasses", (), {"__len__": Masks.__len__, "__getitem__": Masks.__getitem__})
    with pytest.raises(ConfigError, match=r"^dataset._target_=X: the train split needs `classes` \(the class names, "):
        check_sources("X", no_classes(), Masks(), Segmentation())


@pytest.mark.slow
def test_segmentation_trains_a_torchvision_model_through_the_step():
    """A real TrainStep over an untrained LR-ASPP: the loss falls on one batch of masks, evaluation gives figures."""
    cfg = compose_config(["task=segmentation", "hardware=cpu", "trainer.precision=fp32", "optimizer.lr=0.05"])
    assert cfg.model.name == "lraspp_mobilenet_v3_large"  # task=segmentation picks model=segmentation
    from train.loop.model import build_model

    task = build_task(cfg)
    try:
        model = build_model(cfg.model, task.num_outputs(Masks()), CPU)
        step = TrainStep.from_config(cfg, DistEnv(), CPU, model, total_steps=20, task=task)
        images = torch.rand(4, 3, 32, 32)
        targets = (images.mean(1) > 0.5).to(torch.uint8)  # bright pixels are class 1
        targets[:, :2] = 255
        losses = [step(Batch(images, targets))[0].item() for _ in range(8)]
        assert losses[-1] < losses[0]
        figures = evaluation(step)([Batch(images, targets)])
        assert set(figures) == {"val_loss", "val_miou", "val_pixel_acc", "val_samples"} and figures["val_samples"] == 4
    finally:
        build_task(compose_config([]))


@pytest.mark.slow  # a CLI run: 40 steps of LR-ASPP at 64 px (2.4 min on 2 heavily shared cores)
def test_the_default_segmentation_recipe_validates_well_above_predicting_background(tmp_path):
    """Issue 45: training learned while validation (eval mode: BatchNorm's running statistics) predicted background
    everywhere, val_miou 0.17 every epoch. The default model and recipe, a fixed 40 steps, deterministic."""
    root = make_synthetic_voc(tmp_path / "voc", train=128, val=32, size=64)
    run_dir = tmp_path / "run"
    done = run_cli(["task=segmentation", "hardware=cpu", f"data.root={root}", "data.image_size=64",
                    "data.batch_size=16", "data.num_workers=0", "trainer.epochs=5", "trainer.precision=fp32",
                    "trainer.deterministic=true", "trainer.progress=false", "logger=[]", f"hydra.run.dir={run_dir}"])
    assert done.returncode == 0, done.stderr[-3000:]
    counts = np.zeros(256, dtype=np.int64)
    for mask in (root / "SegmentationClass").glob("val_*.png"):
        counts += np.bincount(decode_mask(mask.read_bytes()).flatten().numpy(), minlength=256)
    background_only = np.zeros((5, 5))
    background_only[:, 0] = counts[:5]  # every scored pixel predicted class 0
    floor = scores(background_only)["val_miou"]
    assert 0.1 < floor < 0.25
    assert read_metrics(run_dir)[-1]["val_miou"] > floor + 0.25


def evaluation(step: TrainStep) -> Evaluation:
    """The loop's evaluation (engine.py builds the same) over `step`'s model and forward."""
    return Evaluation(step.ddp, step.predict, step.task, CPU)


# -- the reduction over two real gloo ranks ----------------------------------------------------------------------
def rank_confusion(rank: int) -> np.ndarray:
    return CONFUSION if rank == 0 else CONFUSION.T  # rank 1 sees the transpose: the sum is symmetric


@pytest.mark.slow
def test_the_confusion_matrix_is_summed_over_two_gloo_ranks_once(tmp_path):
    """torchrun, 2 processes on gloo: each rank evaluates its own pixels through the loop's Evaluation (rank 1 twice
    as many batches); every rank reports the figures of the summed matrix. Then rank 1 has no batch at all: it joins
    the one reduction with zeros of the task's width, and both ranks report rank 0's matrix."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          __file__, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    total = rank_confusion(0) + 2 * rank_confusion(1)
    for rank in (0, 1):
        figures = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert figures["val_samples"] == 3
        assert figures["val_miou"] == pytest.approx(scores(total)["val_miou"])
        assert figures["val_pixel_acc"] == pytest.approx(scores(total)["val_pixel_acc"])
        alone = json.loads((tmp_path / f"rank{rank}_alone.json").read_text())
        assert (alone["val_samples"], alone["val_miou"], alone["val_pixel_acc"]) == \
            (1, pytest.approx(MIOU), pytest.approx(PIXEL_ACC))


class OneHotIdentity(torch.nn.Module):
    """A 'model' whose logits are its input (one-hot predictions made by the test), plus a weight for DDP."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": images * self.weight}


def _evaluate_on_this_rank(out_dir: Path) -> None:
    from functools import partial

    import torch.distributed as dist

    from train.loop.config import TrainerConfig
    from train.loop.schedule import warmup_cosine

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    targets, predicted = pixels_of(rank_confusion(rank), ignored=3)
    batch = Batch(one_hot_logits(predicted, 3), targets)
    step = TrainStep(TrainerConfig(precision="fp32"), DistEnv.from_env(), CPU, OneHotIdentity(),
                     optimizer=partial(torch.optim.SGD, lr=0.1), schedule=warmup_cosine, batch_size=1, total_steps=1,
                     input_shape=(3, 1, 1), task=Segmentation(num_classes=3))
    figures = evaluation(step)([batch] * (rank + 1))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(figures))
    figures = evaluation(step)([batch] if rank == 0 else [])
    (out_dir / f"rank{rank}_alone.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


if __name__ == "__main__":
    _evaluate_on_this_rank(Path(sys.argv[1]))


def test_a_non_mask_target_is_passed_as_the_source_gave_it():
    """Integer labels (int, numpy int, a 0-d tensor) become ints the collate stacks to int64; a float target to
    regress keeps its value; only a 2-D uint8 tensor is a mask."""
    from loadout.data.samples import label_of

    assert label_of(torch.tensor(3)) == 3 and isinstance(label_of(torch.tensor(3)), int)
    assert label_of(np.int64(2)) == 2 and isinstance(label_of(np.int64(2)), int)
    assert label_of(0.37) == 0.37
    assert label_of(torch.tensor(0.5)) == 0.5
