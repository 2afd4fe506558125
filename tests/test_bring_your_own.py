"""Bring your own dataset, model, optimizer and augmentation: config groups built with `_target_`, a dataset of
your own from outside the package, augmentation recipes, modes and weights, and one-line config errors."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from hydra.utils import get_object
from omegaconf import OmegaConf

from loadout.build import instantiate
from loadout.data.config import drop_worker_knobs
from loadout.data.pipeline import build_sources
from loadout.dist import DistEnv
from loadout.errors import ConfigError
from loadout.run.overrides import check_command_line
from loadout.runtime import checkpoint
from tests.conftest import CONF, ROOT, compose_config, read_metrics, run_cli, trainer_for
from train.augment import BatchMix
from train.config import SCHEMA, validate
from train.job import data_from_config
from train.loop.model import build_model
from train.loop.step import TrainStep
from train.task import Classification, build_task

CPU = torch.device("cpu")
GROUPS = ("dataset", "model", "optimizer", "scheduler", "augment", "experiment")
EXAMPLE = ROOT / "examples" / "csv_dataset"


def small(root: Path, *extra: str) -> list[str]:
    return ["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16", *extra]


# -- 1. config groups ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group", GROUPS)
def test_each_group_file_opens_with_a_one_line_comment_and_composes(group):
    files = sorted((CONF / group).glob("*.yaml"))
    assert files, group
    for path in files:
        first = path.read_text().splitlines()
        first = first[1] if first[0] == "# @package _global_" else first[0]
        assert first.startswith("# ") and len(first) <= 120, path
        cfg = compose_config([f"{group}={path.stem}"])
        validate(cfg)
        if group != "experiment":
            assert callable(get_object(cfg[group]._target_)), path


def test_optimizer_and_scheduler_come_from_their_groups(tiny_dataset):
    cfg = compose_config(small(tiny_dataset, "optimizer=adamw", "scheduler=cosine", "optimizer.lr=0.002"))
    model = build_model(cfg.model, 10, CPU)
    step = TrainStep.from_config(cfg, DistEnv(), CPU, model, total_steps=100, task=build_task(cfg))
    assert isinstance(step.optimizer, torch.optim.AdamW)
    lrs = []
    for _ in range(100):
        lrs.append(step.scheduler.get_last_lr()[0])
        step.optimizer.step()
        step.scheduler.step()
    assert lrs[0] < lrs[4] == pytest.approx(0.002) and lrs[-1] < 0.0001  # warm-up 5 steps, then the cosine


def test_an_experiment_sets_groups_and_values_and_the_command_line_still_wins():
    cfg = compose_config(["experiment=imagenet_resnet50", "optimizer.lr=0.1"])
    assert cfg.dataset._target_.endswith("ImageFolderDataset") and cfg.augment.crop == "resized"
    assert cfg.model.name == "resnet50" and cfg.trainer.epochs == 90 and cfg.optimizer.lr == 0.1
    assert cfg.scheduler._target_ == "train.loop.schedule.warmup_cosine"


@pytest.mark.slow
def test_cfg_job_shows_the_composed_groups():
    shown = run_cli(["--cfg", "job", "optimizer=adamw"])
    assert shown.returncode == 0, shown.stderr
    composed = OmegaConf.create(shown.stdout)
    assert composed.optimizer._target_ == "torch.optim.AdamW" and composed.dataset._target_
    assert composed.data.num_workers is not None  # every DataLoader knob stays under data.


# -- 2. a dataset of your own ------------------------------------------------------------------------------------
@pytest.fixture
def csv_root(tiny_dataset, tmp_path) -> Path:
    """The tiny ImageFolder listed in list.csv / list_val.csv by the example's script, plus one corrupt file."""
    import subprocess
    import sys

    root = tmp_path / "csv"
    shutil.copytree(tiny_dataset, root)
    (root / "train" / "circle" / "zz_broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    subprocess.run([sys.executable, str(EXAMPLE / "make_csv.py"), str(root)], check=True)
    return root


@pytest.mark.slow
def test_own_dataset_trains_from_outside_the_package_with_every_loader_feature(csv_root, tmp_path):
    """From the command line without a YAML, workers + batch ring + cache, cut mid-epoch; then by its YAML on the
    search path, resumed exactly: the epoch trains every readable sample once and skips the broken one."""
    env = {"PYTHONPATH": f"{EXAMPLE}{os.pathsep}{ROOT}"}  # the example's module, and the template from another folder
    run_dir = tmp_path / "run"
    common = [*small(csv_root, "data.num_workers=2", "data.persistent_workers=true", f"data.cache_bytes={2**24}"),
              "trainer.epochs=1", "trainer.progress=false", "trainer.deterministic=true", f"hydra.run.dir={run_dir}"]
    first = run_cli([*common, "dataset._target_=csv_images.CsvImages", f"+dataset.csv={csv_root / 'list.csv'}",
                     "trainer.max_steps=4"], cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli([*common, f"hydra.searchpath=[file://{EXAMPLE / 'conf'}]", "dataset=csv",
                      "trainer.resume=auto", "trainer.max_steps=null"], cwd=tmp_path, env=env)  # the cut is replayed
    assert second.returncode == 0, second.stderr[-3000:]
    cut, rest = read_metrics(run_dir)
    assert not cut["epoch_complete"] and rest["epoch_complete"]
    assert cut["images"] + cut["bad_samples"] == 64  # 4 batches of 16
    assert rest["images"] + rest["bad_samples"] == 240 and rest["bad_samples"] == 1 and rest["val_samples"] == 80


def test_own_dataset_in_process_gets_the_ring_workers_and_device_batches(csv_root, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    cfg = compose_config(small(csv_root, "data.num_workers=2", "dataset._target_=csv_images.CsvImages",
                               f"+dataset.csv={csv_root / 'list.csv'}"))
    with data_from_config(cfg, DistEnv(), CPU) as data:
        assert data.num_classes == 10 and len(data.train) == 15
        data.set_epoch(0)
        batches = list(data.train)
        assert sum(len(b) for b in batches) + sum(b.bad for b in batches) == 240
        assert all(b.images.dtype == torch.float32 and b.images.shape[1:] == (3, 32, 32) for b in batches if len(b))
        trained = [i for b in batches for i in b.indices.tolist()]
        assert len(set(trained)) == len(trained) == 240 - sum(b.bad for b in batches)  # 241 listed, drop_last


def test_a_target_that_does_not_import_fails_in_one_line_naming_the_key_and_module(tiny_dataset):
    cfg = compose_config(small(tiny_dataset, "dataset._target_=no_such_pkg.Images"))
    with pytest.raises(ConfigError) as err:
        build_sources(cfg.dataset, cfg.data, Classification())
    assert str(err.value).startswith("dataset._target_=no_such_pkg.Images: cannot import")
    assert "'no_such_pkg'" in str(err.value) and "\n" not in str(err.value)
    cfg = compose_config(small(tiny_dataset, "optimizer._target_=torch.optim.NoSuchOptimizer"))
    with pytest.raises(ConfigError, match=r"optimizer._target_=torch.optim.NoSuchOptimizer: cannot import"):
        instantiate("optimizer", cfg.optimizer)


# -- 3. augmentation recipes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["crop_flip", "imagenet", "strong"])
def test_recipes_keep_uint8_samples_drawn_from_seed_epoch_and_index(tiny_dataset, recipe):
    cfg = compose_config(small(tiny_dataset, f"augment={recipe}"))
    dataset, val = data_from_config(cfg, DistEnv(), CPU).samples  # what the workers read
    first = dataset[(0, 5)][0]
    dataset[(0, 6)]
    assert first.dtype == torch.uint8 and first.shape == (3, 32, 32)
    assert torch.equal(first, dataset[(0, 5)][0])
    assert any(not torch.equal(dataset[(0, i)][0], dataset[(1, i)][0]) for i in range(8))
    assert torch.equal(val[3][0], val[3][0])  # validation: Resize -> CenterCrop, no draws


def test_batch_mix_is_soft_and_a_function_of_seed_epoch_and_batch():
    mix = BatchMix(10, seed=0, mixup_alpha=0.2, cutmix_alpha=1.0)
    images, targets = torch.rand(8, 3, 16, 16), torch.arange(8) % 10
    a, soft = mix(images, targets, 1, 3)
    b, again = mix(images, targets, 1, 3)
    assert torch.equal(a, b) and torch.equal(soft, again) and soft.shape == (8, 10)
    assert torch.allclose(soft.sum(1), torch.ones(8))
    assert any(not torch.equal(mix(images, targets, 1, k)[0], a) for k in range(4, 8))


# -- 4. modes and weights --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_best_checkpoint_and_validate_mode_write_one_row(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    trained = run_cli([*small(tiny_dataset, "data.num_workers=1", "augment=strong", "trainer.epochs=2",
                              "trainer.progress=false", f"hydra.run.dir={run_dir}")])
    assert trained.returncode == 0, trained.stderr[-3000:]
    records = read_metrics(run_dir)
    best = checkpoint.checkpoint_dir(run_dir) / checkpoint.BEST
    assert best.is_file() and (checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST).is_file()
    check_dir = tmp_path / "check"
    checked = run_cli([*small(tiny_dataset, "data.num_workers=1", "trainer.mode=validate", f"trainer.resume={best}",
                              "trainer.progress=false", f"hydra.run.dir={check_dir}")])
    assert checked.returncode == 0, checked.stderr[-3000:]
    [row] = read_metrics(check_dir)
    assert row["mode"] == "validate" and row["val_samples"] == 80
    assert row["val_acc"] == pytest.approx(max(r["val_acc"] for r in records), abs=1e-9)


def test_a_model_of_your_own_by_target_alone(tiny_dataset):
    cfg = compose_config(small(tiny_dataset, "model._target_=torchvision.models.SqueezeNet"))
    model = build_model(cfg.model, 10, CPU)  # the torchvision file's `name` is left out: the class takes none
    assert type(model).__name__ == "SqueezeNet" and model(torch.zeros(1, 3, 32, 32)).shape == (1, 10)


def test_model_weights_start_from_a_state_dict_on_disk(tmp_path):
    spec = OmegaConf.create({"_target_": "train.loop.model.torchvision_model", "name": "resnet18", "weights": None})
    saved = build_model(spec, 10, CPU)
    torch.save(saved.state_dict(), tmp_path / "w.pt")
    spec.weights = str(tmp_path / "w.pt")
    loaded = build_model(spec, 10, CPU)
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), loaded.state_dict().values(),
                                                 strict=True))
    with pytest.raises(ConfigError, match="does not fit this model") as err:
        build_model(spec, 7, CPU)  # another head
    assert "\n" not in str(err.value)
    spec.weights = str(tmp_path / "missing.pt")
    with pytest.raises(ConfigError, match="no such file"):
        build_model(spec, 10, CPU)


# -- 5. config UX ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", ["cpu", "rtx3060", "rtx4080", "a100", "auto"])
def test_num_workers_0_works_with_every_profile(profile):
    cfg = compose_config([f"hardware={profile}", "data.num_workers=0"])
    dropped = drop_worker_knobs(cfg, typed={"data.num_workers"})
    validate(cfg)
    assert all(key.startswith("data.") for key in dropped)


def test_only_a_typed_contradiction_fails():
    cfg = compose_config(["hardware=a100", "data.num_workers=0", "data.prefetch_factor=4"])
    drop_worker_knobs(cfg, typed={"data.num_workers", "data.prefetch_factor"})
    with pytest.raises(ConfigError, match="data.prefetch_factor=4: only valid with data.num_workers > 0"):
        validate(cfg)


@pytest.mark.parametrize(("override", "message"), [
    ("data.num_wrkers=2", "data.num_wrkers: did you mean data.num_workers?"),
    ("trainer.epoch=3", "trainer.epoch: did you mean trainer.epochs?"),
    ("trainer.lr=0.1", "trainer.lr: did you mean optimizer.lr?"),
    ("dataset=imagenet", "dataset=imagenet: no conf/dataset/imagenet.yaml; choose one of cifar10, hdf5, imagefolder"),
])
def test_a_typo_names_the_closest_real_key_in_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        check_command_line([override], SCHEMA)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.slow
def test_the_cli_prints_the_typo_line_and_exits_2(small_run_args):
    result = run_cli([*small_run_args, "data.num_wrkers=2"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: data.num_wrkers: did you mean data.num_workers?"]


# -- 4. the source interface (loadout/data/source.py) -----------------------------------------------------------
class NoClasses(torch.utils.data.Dataset):
    def __init__(self, split: str = "train"):
        pass

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        return torch.zeros(3, 8, 8, dtype=torch.uint8), 0


class FloatImages(NoClasses):
    classes = ["a"]

    def __getitem__(self, index: int):
        return torch.zeros(3, 8, 8), 0


@pytest.mark.parametrize(("source", "message"), [
    ("NoClasses", "the train split needs `classes` (the class names), `__len__` and `__getitem__`"),
    ("FloatImages", "dataset[0] must be (image, label) with a PIL image or a uint8 CHW tensor"),
])
def test_a_source_is_checked_once_at_build_time_in_one_line(tiny_dataset, source, message):
    cfg = compose_config(small(tiny_dataset, f"dataset._target_=tests.test_bring_your_own.{source}"))
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        build_sources(cfg.dataset, cfg.data, Classification())
    assert str(err.value).startswith(f"dataset._target_=tests.test_bring_your_own.{source}:")
    assert "\n" not in str(err.value)


def test_every_source_goes_through_one_sample_path_packed_included(tiny_dataset, tmp_path):
    """The packed format crops whole batches, still inside Samples: the stuck-read note and the bad-sample guard hold
    for it (a batch whose read fails goes one by one, and the bad sample is skipped, named)."""
    from loadout.data.datasets import ImageFolderDataset
    from loadout.data.fast.packed import PackedDataset
    from scripts.pack_dataset import pack_split

    for split in ("train", "val"):
        pack_split(ImageFolderDataset(tiny_dataset, split), tmp_path / split, 37)

    class Flaky(PackedDataset):
        """Sample 5's pages cannot be read (a failing disk)."""

        def read_crops(self, indices, *args):
            if 5 in list(indices):
                raise OSError("Input/output error")
            return super().read_crops(indices, *args)

        def __getitem__(self, index: int):
            if index == 5:
                raise OSError("Input/output error")
            return super().__getitem__(index)

    cfg = compose_config(small(tmp_path, "dataset=packed", "data.num_workers=0", "data.batch_size=8"))
    data = data_from_config(cfg, DistEnv(), CPU)
    train = data.samples[0]
    assert type(train).__name__ == "Samples" and train.crops is not None
    train.source = Flaky(tmp_path / "train")
    batch = train.__getitems__([(0, i) for i in range(8)])
    assert batch[5] is None and all(sample is not None for i, sample in enumerate(batch) if i != 5)
    assert [sample[2] for sample in batch if sample is not None] == [0, 1, 2, 3, 4, 6, 7]


def test_a_train_step_is_built_from_typed_parts_without_hydra():
    from functools import partial

    from loadout.data.loader.batch import Batch
    from train.loop.config import TrainerConfig
    from train.loop.schedule import warmup_cosine

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4))
    step = TrainStep(TrainerConfig(precision="fp32"), DistEnv(), CPU, model, optimizer=partial(torch.optim.SGD, lr=0.5),
                     schedule=warmup_cosine, batch_size=4, total_steps=10, input_shape=(3, 8, 8))
    batch = Batch(torch.rand(4, 3, 8, 8), torch.arange(4))
    first, updated = step(batch)
    assert updated
    for _ in range(5):
        loss, _ = step(batch)
    assert float(loss) < float(first)


# -- 5. a task of your own ---------------------------------------------------------------------------------------
COUNTING = ROOT / "examples" / "counting"


@pytest.mark.slow
def test_own_task_in_one_file_trains_from_outside_the_package(tmp_path, monkeypatch):
    """examples/counting: its task (a regression: MSE, val_mae, best by the lowest) and its source, named by the
    example's YAML on the search path, trained by the loop; its figures join the vocabulary and best.pt follows
    val_mae."""
    from loadout.observe.metrics import EPOCH
    from train.job import data_from_config

    monkeypatch.syspath_prepend(str(COUNTING))
    cfg = compose_config([f"hydra.searchpath=[file://{COUNTING / 'conf'}]", "task=counting", "hardware=cpu",
                          "dataset._target_=counting.Squares", "~dataset.root", "data.image_size=32",
                          "data.batch_size=16", "data.num_workers=0", "augment.flip=false", "trainer.epochs=5",
                          "trainer.progress=false", "model._target_=tests.tiny_net.TinyNet", "~model.name",
                          "optimizer=adamw", "optimizer.lr=0.05", "logger=[]"])
    task = build_task(cfg)
    try:
        assert "val_mae" in EPOCH and "val_acc" not in EPOCH
        with data_from_config(cfg, DistEnv(), CPU) as data:
            model = build_model(cfg.model, task.num_outputs(data.source), CPU)
            records = trainer_for(cfg, data, tmp_path, model=model, task=task).fit()
    finally:
        build_task(compose_config([]))
    assert records[-1]["val_mae"] < 0.6 < records[0]["val_mae"] or records[-1]["val_mae"] < 0.4, records
    assert records[-1]["val_samples"] == 128 and "val_acc" not in records[-1]
    best = torch.load(checkpoint.checkpoint_dir(tmp_path) / checkpoint.BEST, weights_only=True)
    assert best["progress"]["best"] == min(r["val_mae"] for r in records)
