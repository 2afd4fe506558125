"""The real CLI end to end: workers, JPEG decoding, metrics.jsonl, resume, and bad input before any worker."""

from __future__ import annotations

import pytest
import yaml

from loadout.observe.metrics import EPOCH
from tests.conftest import read_metrics, run_cli

FIELDS = ("epoch", "train_loss", "val_loss", "val_acc", "images_per_s", "data_wait_frac", "first_batch_s", "epoch_s",
          "peak_pss_mb", "bad_samples")


@pytest.mark.slow
def test_two_epochs_with_persistent_workers_learn_and_write_metrics(learn_dataset, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(["hardware=cpu", f"data.root={learn_dataset}", "data.image_size=32", "data.batch_size=16",
                      "data.num_workers=2", "data.persistent_workers=true", "trainer.epochs=2",
                      "trainer.progress=false", f"hydra.run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr
    records = read_metrics(run_dir)
    assert [r["epoch"] for r in records] == [1, 2]
    for record in records:
        for field in FIELDS:
            assert field in record, field
        assert set(record) <= set(EPOCH), "every key a record has is named in loadout/observe/metrics.py's vocabulary"
        assert record["images_per_s"] > 0 and 0 <= record["data_wait_frac"] < 1
        assert record["first_batch_s"] > 0 and record["peak_pss_mb"] > 100
    assert records[-1]["val_acc"] > 0.3, records  # 10 classes: chance is 0.1
    assert records[-1]["val_samples"] == 200
    resolved = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert resolved["data"]["num_workers"] == 2 and resolved["data"]["persistent_workers"] is True
    assert (run_dir / "checkpoints" / "last.pt").is_file()
    assert "epoch 2/2" in result.stderr + result.stdout  # one summary line per epoch on the console


@pytest.mark.slow
def test_resume_auto_continues_without_repeating_an_epoch(small_run_args, tmp_path):
    run_dir = tmp_path / "run"
    # 240 train images / batch 16 = 15 steps per epoch: max_steps=15 stops cleanly after epoch 1.
    first = run_cli([*small_run_args, "data.num_workers=1", "trainer.epochs=2", "trainer.max_steps=15"])
    assert first.returncode == 0, first.stderr
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1]
    # the run's own overrides are replayed (trainer.max_steps=15 included): lifting the cut is said
    second = run_cli([*small_run_args, "trainer.resume=auto", "trainer.max_steps=null"])
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr + second.stdout
    records = read_metrics(run_dir)
    assert [r["epoch"] for r in records] == [1, 2]
    third = run_cli([*small_run_args, "data.num_workers=1", "trainer.epochs=2", "trainer.resume=auto"])
    assert third.returncode == 0, third.stderr
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1, 2]  # nothing left to do, nothing redone


@pytest.mark.parametrize("override, message", [
    ("data.root=/no/such/dataset", "data.root='/no/such/dataset' does not exist"),
    ("data.prefetch_factor=2", "data.prefetch_factor=2"),
])
@pytest.mark.slow
def test_bad_input_is_one_line_before_any_worker(small_run_args, override, message):
    result = run_cli([*small_run_args, "data.num_workers=0", "data.persistent_workers=false", override])
    assert result.returncode == 2
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_root_without_images_is_rejected(small_run_args, tmp_path):
    empty = tmp_path / "empty"
    (empty / "train" / "cat").mkdir(parents=True)
    (empty / "val" / "cat").mkdir(parents=True)
    result = run_cli([*small_run_args, f"data.root={empty}"])
    assert result.returncode == 2
    assert "data.root: no images under" in result.stderr


@pytest.mark.slow
def test_typo_fails_at_the_command_line(small_run_args):
    result = run_cli([*small_run_args, "data.num_wrkers=2"])
    assert result.returncode != 0
    assert "num_wrkers" in result.stderr


@pytest.mark.slow
def test_pin_memory_without_cuda_warns_and_trains(small_run_args, tmp_path):
    result = run_cli([*small_run_args, "data.num_workers=0", "data.persistent_workers=false",
                      "data.pin_memory=true", "trainer.max_steps=2", "trainer.epochs=1"])
    assert result.returncode == 0, result.stderr
    assert "data.pin_memory=true without CUDA" in result.stdout + result.stderr
