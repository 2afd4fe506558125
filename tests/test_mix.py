"""dataset=mix with real parts: the tiny JPEG folder and shards written by scripts/make_shards.py, locally and from
moto's S3 server, mixed 3:1; the draw, the per-source counts in metrics.jsonl, exact resume after a real SIGTERM,
and bad config or a failing source named in one line."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from loadout.data.loader.samplers import build_sampler
from loadout.data.mix import MixReadError, MixSource
from loadout.data.pipeline import build_sources
from loadout.data.samples import Samples
from loadout.data.source import check_first, sample_name
from loadout.dist import DistEnv
from loadout.errors import ConfigError
from loadout.observe.metrics import EPOCH
from tests.conftest import (
    RECORD_SAMPLES,
    ROOT,
    compose_config,
    epoch_samples,
    read_metrics,
    run_cli,
    training_at,
    wait_for,
)
from tests.test_shards import s3 as s3_server  # noqa: F401  (moto's S3 server with the shards, as a fixture)
from train.job import data_from_config
from train.task.classification import Classification

PER_EPOCH, BATCH = 96, 16  # 3:1 of 96: 72 folder samples and 24 from the shards an epoch, 6 batches
RUN_EPOCH = 960  # a run's epoch: 720 folder samples (3 passes) and 240 from S3 (1 pass), 60 batches of a tiny net


def mix_of(folder: Path, shards: Path, cache: Path, samples_per_epoch: int = PER_EPOCH, **kwargs) -> MixSource:
    sources = {"folder": {"_target_": "loadout.data.datasets.ImageFolderDataset", "root": str(folder), "weight": 3},
               "shards": {"_target_": "loadout.data.remote.shards.ShardSource", "root": str(shards), "weight": 1,
                          "cache_dir": str(cache)}}
    return MixSource(sources, "train", seed=7, samples_per_epoch=samples_per_epoch, **kwargs)


def test_each_source_gets_its_weighted_share_spread_evenly_and_goes_through_its_samples_before_repeats(
        tiny_dataset, shards, tmp_path):
    mix = mix_of(tiny_dataset, shards, tmp_path)
    assert list(mix.classes) == list(mix.sources[0].classes) == list(mix.sources[1].classes)
    seen_from_shards = []
    for epoch in range(10):
        which, sample = mix.plan(epoch)
        assert np.bincount(which).tolist() == [72, 24], "exact shares: largest remainders of 96 x 3/4 and 1/4"
        per_batch = np.bincount(np.repeat(np.arange(PER_EPOCH // BATCH), BATCH)[which == 0])
        assert np.all(np.abs(per_batch - 12) <= 2), per_batch  # stratified: every batch close to 3:1
        seen_from_shards += sample[which == 1].tolist()
    # 10 epochs x 24 = the shards' 240 samples: each once before any repeats (without replacement across epochs)
    assert sorted(seen_from_shards) == list(range(240))
    again = mix_of(tiny_dataset, shards, tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(mix.plan(3), again.plan(3), strict=True)), "(seed, epoch) alone"
    mix.set_epoch(3)
    part, index = mix.locate(5)
    image, label = mix[5]
    assert image.dtype == torch.uint8 and label == int(mix.sources[part][index][1])
    assert sample_name(mix, 5).startswith(f"dataset.sources.{mix.names[part]}: ")

    oversampled = mix_of(tiny_dataset, shards, tmp_path, samples_per_epoch=960)  # the folder drawn 720 of its 240
    which, sample = oversampled.plan(0)
    assert np.bincount(sample[which == 0], minlength=240).tolist() == [3] * 240, "whole passes, each sample once"

    # the sampler keeps the mix's order and splits it over ranks in contiguous parts, each position once
    data = compose_config(["hardware=cpu", "dataset=mix"]).data
    samples = Samples(mix, lambda image: image, seed=7)
    parts = [list(build_sampler(samples, data, DistEnv(rank=r, world_size=2), train=True, seed=7)) for r in (0, 1)]
    assert parts == [list(range(48)), list(range(48, 96))]


def one_line_error(overrides: list[str], build=build_sources) -> str:
    cfg = compose_config(["hardware=cpu", "dataset=mix", *overrides])
    with pytest.raises(ConfigError) as err:
        build(cfg.dataset, cfg.data, Classification()) if build is build_sources else build(cfg, DistEnv(), None)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_bad_config_fails_in_one_line_naming_the_key_before_any_worker_starts(tiny_dataset, tmp_path):
    folder = f"data.root={tiny_dataset}"
    assert one_line_error([folder, "dataset.sources.main.weight=0"]).startswith("dataset.sources.main.weight=0:")
    assert one_line_error([folder, "dataset.sources.main.weight=-1"]).startswith("dataset.sources.main.weight=-1:")
    assert "dataset.sources: name at least one source" in one_line_error([folder, "~dataset.sources.main"])
    assert "dataset.sources.other: needs a _target_" in one_line_error(
        [folder, "+dataset.sources.other={root: /x, weight: 1}"])
    unknown = one_line_error([folder, "+dataset.sources.main.rotate=90"])
    assert unknown.startswith("dataset.sources.main._target_=loadout.data.datasets.ImageFolderDataset") and \
        "rotate" in unknown
    missing = one_line_error([folder, f"+dataset.sources.gone={{_target_: loadout.data.datasets.ImageFolderDataset, "
                                      f"root: {tmp_path / 'nowhere'}, weight: 1}}"])
    assert missing.startswith("dataset.sources.gone: ") and "nowhere" in missing
    assert one_line_error([folder, "dataset.samples_per_epoch=0"]).startswith("dataset.samples_per_epoch=0:")
    assert one_line_error([folder, "dataset.samples_per_epoch=1", "+dataset.sources.small={_target_: "
                           f"loadout.data.datasets.ImageFolderDataset, root: {tiny_dataset}, weight: 1}}"]) \
        .startswith("dataset.sources.")  # a weight too small to give its source any sample of the epoch
    assert one_line_error([folder, "data.cache_bytes=1000000"], data_from_config).startswith("data.cache_bytes=")
    assert one_line_error([folder, "data.sampler=weighted"], data_from_config).startswith("data.sampler=weighted:")


def test_an_unreadable_sample_names_its_source(tiny_dataset, tmp_path, caplog):
    broken = tmp_path / "broken"
    first, second = sorted(path.name for path in (tiny_dataset / "train").iterdir())[:2]
    for split in ("train", "val"):
        for name in (first, second):
            shutil.copytree(tiny_dataset / split / name, broken / split / name)
    for path in (broken / "train" / first).iterdir():
        path.write_bytes(path.read_bytes()[:100])  # truncated JPEGs
    sources = {"good": {"_target_": "loadout.data.datasets.ImageFolderDataset", "root": str(tiny_dataset), "weight": 1},
               "broken": {"_target_": "loadout.data.datasets.ImageFolderDataset", "root": str(broken), "weight": 1}}
    mix = MixSource(sources, "train", seed=1, samples_per_epoch=64)
    which, sample = mix.plan(0)
    from_broken = np.flatnonzero(which == 1)
    position = int(from_broken[mix.sources[1].targets[sample[from_broken]] == 0][0])  # a truncated file
    with pytest.raises(MixReadError, match=r"^dataset\.sources\.broken: "):
        mix[position]
    samples = Samples(mix, lambda image: image, seed=1)
    with caplog.at_level(logging.WARNING):
        assert samples[(0, position)] is None  # skipped as a bad sample, and the log line names the source
    assert "skipping unreadable sample dataset.sources.broken: " in caplog.text
    cfg = compose_config(["hardware=cpu", "dataset=mix"])
    cfg.dataset.sources = sources  # its first class's files all truncated: none of the first samples the build tries
    folder = re.escape(str(broken / "train" / first))
    with pytest.raises(ConfigError, match=rf"^dataset\.sources\.broken: none of its first 8 samples reads "
                                          rf"\(the first, {folder}/[^ ]+\.jpg \(sample 0\): "):
        build_sources(cfg.dataset, cfg.data, Classification())


def run_args(folder: Path, run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return ["hardware=cpu", "dataset=mix", f"data.root={folder}", "data.image_size=32", f"data.batch_size={BATCH}",
            "data.num_workers=2", "trainer.epochs=2", "trainer.deterministic=true", RECORD_SAMPLES,
            "trainer.progress=false", "model._target_=tests.tiny_net.TinyNet", "logger=[]",
            f"dataset.samples_per_epoch={RUN_EPOCH}", "~dataset.sources.main",
            "+dataset.sources.folder={_target_: loadout.data.datasets.ImageFolderDataset, root: '${data.root}', "
            "weight: 3}",
            "+dataset.sources.s3={_target_: loadout.data.remote.shards.ShardSource, root: 's3://loadout/shards', "
            "weight: 1, "
            f"cache_dir: '{cache}', timeout: '${{data.timeout}}'}}",
            f"hydra.run.dir={run_dir}", *extra]


@pytest.mark.slow  # three runs and the S3 server
def test_a_folder_and_s3_shards_mixed_3_to_1_count_per_source_and_resume_exactly_after_sigterm(
        s3_server, tiny_dataset, tmp_path):  # noqa: F811  (the fixture imported above)
    s3 = s3_server  # the environment that reaches it
    from tests.test_preemption import assert_same_weights, last_checkpoint

    reference = tmp_path / "reference"
    done = run_cli(run_args(tiny_dataset, reference, tmp_path / "cache-ref"), env=s3)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(reference)
    assert set(records[-1]) <= set(EPOCH)
    # each position trained once an epoch (drop_last, 60 whole batches): the counts are the shares exactly
    assert [r["source_samples"] for r in records] == [{"folder": 720, "s3": 240}] * 2
    assert records[-1]["val_samples"] == 160  # each source's val split whole: 80 + 80

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "train", *run_args(tiny_dataset, run_dir, tmp_path / "cache")],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT), **s3}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: training_at(run_dir) >= (1, 2), 300, "epoch 2 to be under way")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out[-3000:]
    stopped_at = last_checkpoint(run_dir)["progress"]["batch_in_epoch"]
    assert 0 < stopped_at < RUN_EPOCH // BATCH, "stopped mid-epoch"
    resumed = run_cli(run_args(tiny_dataset, run_dir, tmp_path / "cache", "trainer.resume=auto"), env=s3)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for epoch in range(2):  # the same positions, so the same (source, sample) at each: the mix is (seed, epoch)'s
        assert epoch_samples(run_dir, epoch, 0) == epoch_samples(reference, epoch, 0), epoch
    assert_same_weights(run_dir, reference)
    # the resumed epoch counts its samples before the stop too (the checkpoint keeps them)
    assert read_metrics(run_dir)[-1]["source_samples"] == records[-1]["source_samples"] == {"folder": 720, "s3": 240}


def test_a_mix_sample_of_the_wrong_kind_is_one_line_naming_its_source():
    """A source's sample that reads but is not (image, label) as the mix hands it on (a float image, say): one
    line naming dataset.sources.<name>, not a traceback."""
    def read(index):
        raise TypeError("a uint8 image, not float32")

    with pytest.raises(ConfigError, match=r"^dataset\.sources\.odd: its sample 0 must be \(image, label\).*float32"):
        check_first("dataset.sources.odd", [None] * 3, read, "its sample {}", Classification(), unreadable=OSError)
