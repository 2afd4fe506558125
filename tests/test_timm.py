"""model=timm with real timm models on the CPU: compiled and channels_last; under torchrun (gloo, DDP) with the
strong recipe (MixUp / CutMix) from a state dict on disk; a name timm does not know, in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import read_metrics, run_cli
from tests.test_distributed import only_run_dir, torchrun


def args(root: Path, *extra: str) -> list[str]:
    return ["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16", "trainer.epochs=1",
            "trainer.progress=false", "logger=[]", "model=timm", *extra]


@pytest.mark.slow
def test_a_timm_model_trains_compiled_and_channels_last(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(args(tiny_dataset, "model.name=test_resnet", "trainer.compile=true",
                          "trainer.channels_last=true", "trainer.max_steps=3", f"hydra.run.dir={run_dir}"))
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = read_metrics(run_dir)
    assert record["val_samples"] == 80 and torch.isfinite(torch.tensor(record["train_loss"]))


@pytest.mark.slow
def test_a_timm_model_under_torchrun_with_the_strong_recipe_from_weights_on_disk(tiny_dataset, tmp_path):
    import timm

    weights = tmp_path / "vit.pt"
    start = timm.create_model("test_vit", num_classes=10, img_size=32)
    torch.save(start.state_dict(), weights)
    result = torchrun(args(tiny_dataset, "model.name=test_vit", "+model.img_size=32", f"model.weights={weights}",
                           "augment=strong", "data.num_workers=1", "trainer.max_steps=4"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    (record,) = read_metrics(run_dir)
    assert record["val_samples"] == 80 and record["images"] == 4 * 16 * 2
    trained = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert trained.keys() == start.state_dict().keys()
    assert not torch.equal(trained["head.weight"], start.state_dict()["head.weight"])


@pytest.mark.slow
def test_a_name_timm_does_not_know_fails_in_one_line(tiny_dataset, tmp_path):
    result = run_cli(args(tiny_dataset, "model.name=resnet51", f"hydra.run.dir={tmp_path / 'run'}"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: model.name='resnet51': not a timm model")
