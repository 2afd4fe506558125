"""The sharded training order mixes labels like a full shuffle at the default settings, however the shards were
written: class-sorted shards from webdataset's ShardWriter over a folder walk (real JPEG tars), shuffled ones, and
label layouts too large to write here (labels only); the window stays a pure function of the data, bounded, and a
window that cannot mix sorted shards is said in one line."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from loadout.data.datasets import ImageFolderDataset
from loadout.data.loader.samplers import ShardWindowSampler
from loadout.data.remote.shard_order import DEFAULT_WINDOW, MOST_SAMPLES, shard_window, spread_of_labels
from loadout.data.remote.shards import ShardSource
from loadout.errors import ConfigError

BATCH = 16


def distinct_per_batch(labels: np.ndarray, order: np.ndarray, batch: int = BATCH) -> float:
    batches = np.sort(labels[order[:len(order) // batch * batch]].reshape(-1, batch), axis=1)
    return float(((np.diff(batches, axis=1) != 0).sum(axis=1) + 1).mean())


def full_shuffle(labels: np.ndarray, batch: int = BATCH) -> float:
    """Distinct labels a batch of a full shuffle holds, over a few seeds."""
    return float(np.mean([distinct_per_batch(labels, np.random.default_rng(seed).permutation(len(labels)), batch)
                          for seed in range(5)]))


def window_order(starts: np.ndarray, window: int, epoch: int = 0) -> np.ndarray:
    sampler = ShardWindowSampler(starts, window, seed=0, rank=0, world_size=1)
    sampler.set_epoch(epoch)
    return sampler.order()


@pytest.fixture(scope="module")
def sorted_shards(tiny_dataset, tmp_path_factory):
    """The tiny set walked class by class (as a folder lists it) into webdataset ShardWriter shards of 8 samples, no
    _info.json: each shard holds one class."""
    import webdataset

    out = tmp_path_factory.mktemp("sorted-wds")
    for split in ("train", "val"):
        (out / split).mkdir()
        folder = ImageFolderDataset(tiny_dataset, split)
        with webdataset.ShardWriter(str(out / split / "part-%04d.tar"), maxcount=8, verbose=0) as sink:
            for index in range(len(folder)):
                sink.write({"__key__": f"s{index:05d}", "jpg": folder.read_encoded(index)[0],
                            "cls": int(folder.targets[index])})
    return out


def test_class_sorted_shardwriter_shards_mix_labels_like_a_full_shuffle_at_the_default_window(sorted_shards,
                                                                                                tmp_path):
    source = ShardSource(str(sorted_shards), "train", cache_dir=str(tmp_path / "cache"))
    labels = np.array([source.read_encoded(index)[1] for index in range(len(source))])
    assert (np.diff(labels) >= 0).all(), "written class by class"
    window = shard_window(source.shard_starts, None, source.label_spread)
    full = full_shuffle(labels)
    for epoch in (0, 1):
        order = window_order(source.shard_starts, window, epoch)
        assert sorted(order.tolist()) == list(range(len(source)))
        assert distinct_per_batch(labels, order) >= 0.9 * full, f"epoch {epoch}: batches mix like a full shuffle"
    old = distinct_per_batch(labels, window_order(source.shard_starts, 4))
    assert old < 0.6 * full, "the old window of 4 shards walks through the classes (what the test guards against)"


def test_a_window_that_cannot_mix_sorted_shards_is_said_in_one_line(sorted_shards, tmp_path, caplog):
    source = ShardSource(str(sorted_shards), "train", cache_dir=str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="loadout.data.remote.shard_order"):
        assert shard_window(source.shard_starts, 4, source.label_spread) == 4  # set: kept, and said
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "dataset.shuffle_window: the shards are sorted by label" in warnings[0]
    assert "set dataset.shuffle_window=null" in warnings[0] and "make_shards.py" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loadout.data.remote.shard_order"):
        shard_window(source.shard_starts, None, source.label_spread)  # the default mixes them: nothing to warn of
        shard_window(source.shard_starts, 4, source.label_spread, announce=False)  # ranks > 0 say nothing
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_window_is_a_function_of_the_data_the_same_on_every_build(sorted_shards, tmp_path):
    """Every rank, worker count and resume builds its own source: the labels looked at, and so the window and the
    order, are the same each time."""
    first = ShardSource(str(sorted_shards), "train", cache_dir=str(tmp_path / "a"))
    again = ShardSource(str(sorted_shards), "train", cache_dir=str(tmp_path / "b"))
    assert first.label_spread() == again.label_spread()
    windows = [shard_window(s.shard_starts, None, s.label_spread, announce=False) for s in (first, again)]
    assert windows[0] == windows[1]
    assert np.array_equal(window_order(first.shard_starts, windows[0], 3),
                          window_order(again.shard_starts, windows[1], 3))


def shard_labels(labels: np.ndarray, starts: np.ndarray) -> list[np.ndarray]:
    return [labels[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def layout(classes: int, per_class: int, per_shard: int, shuffled: bool) -> tuple[np.ndarray, np.ndarray]:
    labels = np.repeat(np.arange(classes), per_class)
    if shuffled:
        labels = np.random.default_rng(1).permutation(labels)
    return labels, np.append(np.arange(0, len(labels), per_shard), len(labels))


def test_a_large_sorted_set_gets_a_window_that_mixes_it_while_reads_stay_within_a_window():
    """100 classes x 1000 in sorted shards of 97 (labels only): the sized window is a part of the set, not all of
    it, and its batches hold nearly a full shuffle's labels."""
    labels, starts = layout(100, 1000, 97, shuffled=False)
    spread = spread_of_labels(shard_labels(labels, starts), 100)
    window = shard_window(starts, None, lambda: spread, announce=False)
    shards = len(starts) - 1
    assert window * 97 <= MOST_SAMPLES and window < shards / 2, "a window, not the whole set"
    order = window_order(starts, window)
    assert distinct_per_batch(labels, order, 64) >= 0.9 * full_shuffle(labels, 64)
    shard_of = np.searchsorted(starts, order, side="right") - 1
    first_window = set(shard_of[:window * 97 - 97].tolist())
    assert len(first_window) <= window, "the first window's reads touch its own shards only"


def test_shuffled_shards_keep_the_small_window_and_mix_anyway():
    labels, starts = layout(100, 1000, 97, shuffled=True)
    spread = spread_of_labels(shard_labels(labels, starts), 100)
    assert spread.mixed
    assert shard_window(starts, None, lambda: spread, announce=False) == DEFAULT_WINDOW
    assert distinct_per_batch(labels, window_order(starts, DEFAULT_WINDOW), 64) >= 0.95 * full_shuffle(labels, 64)
    assert shard_window(starts, None, None) == DEFAULT_WINDOW, "a source that cannot tell keeps the old window"


def test_the_sized_window_is_bounded_and_says_so_when_sorted_shards_need_more(caplog):
    """ImageNet-sized, sorted in shards of 1000: mixing needs nearly the whole set; the window stays within
    MOST_SAMPLES and the one-line warning names the window that would mix it."""
    labels, starts = layout(1000, 1300, 1000, shuffled=False)
    spread = spread_of_labels(shard_labels(labels, starts), 1000)
    with caplog.at_level(logging.INFO, logger="loadout.data.remote.shard_order"):
        window = shard_window(starts, None, lambda: spread)
    assert window == MOST_SAMPLES // 1000
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "set dataset.shuffle_window=1300" in warnings[0]


def test_shards_hold_no_more_indexes_than_a_window_needs(sorted_shards, tmp_path):
    source = ShardSource(str(sorted_shards), "train", cache_dir=str(tmp_path / "cache"))
    source.INDEXES_HELD, source.SAMPLES_HELD = 2, 40  # 30 shards of 8: at least 2 held, more up to 40 samples
    for index in np.random.default_rng(0).permutation(len(source)).tolist():
        source.read_encoded(index)
    held = sum(len(index["labels"]) for index in source._held.values())
    assert 2 <= len(source._held) <= 5 and held <= 40 and held == source._held_samples


def test_labels_per_shard_in_info_json_spare_the_look_and_a_wrong_count_fails_in_one_line(sorted_shards,
                                                                                           tmp_path):
    import shutil

    root = tmp_path / "listed"
    shutil.copytree(sorted_shards, root)
    names = sorted(p.name for p in (root / "train").glob("*.tar"))
    splits = {"train": {"filenames": [f"train/{n}" for n in names], "shard_lengths": [8] * len(names),
                        "labels_per_shard": [1] * len(names)}}
    (root / "_info.json").write_text(json.dumps({"classes": [str(c) for c in range(10)], "splits": splits}))
    cache = tmp_path / "cache"
    source = ShardSource(str(root), "train", cache_dir=str(cache))
    spread = source.label_spread()
    assert spread.per_shard == 1 and not spread.mixed
    assert not list(cache.glob("*.index.npz")), "no shard indexed to tell"
    splits["train"]["labels_per_shard"] = [1, 1]
    (root / "_info.json").write_text(json.dumps({"classes": [str(c) for c in range(10)], "splits": splits}))
    with pytest.raises(ConfigError, match=r"_info.json's labels_per_shard has 2 entries for 30 train shards"):
        ShardSource(str(root), "train", cache_dir=str(cache))


def test_the_training_batches_over_sorted_shards_mix_labels_at_the_default_settings(sorted_shards, tmp_path):
    """The real path, `dataset=shards` with nothing else set: the training loader's batches (2 workers, real JPEG
    decoding) hold as many labels as a full shuffle's, where the old window of 4 shards held a few."""
    import torch

    from loadout.dist import DistEnv
    from tests.conftest import compose_config
    from train.job import data_from_config

    cfg = compose_config(["hardware=cpu", "dataset=shards", f"data.root={sorted_shards}", "data.image_size=32",
                          f"data.batch_size={BATCH}", "data.num_workers=2", "trainer.epochs=1",
                          f"dataset.cache_dir={tmp_path / 'cache'}"])
    with data_from_config(cfg, DistEnv(), torch.device("cpu")) as data:
        data.train.batches.start_epoch, data.train.batches.start_batch = 0, 0
        batches = [batch.targets.numpy() for batch in data.train.loader]
    labels = np.concatenate(batches)
    assert len(labels) == 240
    whole = [len(np.unique(batch)) for batch in batches if len(batch) == BATCH]
    assert np.mean(whole) >= 0.9 * full_shuffle(np.sort(labels))


@pytest.mark.slow  # a 2-epoch training run (~30 s on 2 cores)
def test_class_sorted_shards_train_like_the_folder_at_the_default_settings(learn_dataset, tmp_path):
    """Issue 37's trial as a new user makes it: a folder walked into ShardWriter shards, `dataset=shards`, nothing
    else set. The window of 4 shards trained to val_acc ~0.2 (chance 0.1) where the folder reaches ~0.9 (test_train)."""
    import webdataset

    from tests.conftest import read_metrics, run_cli

    for split in ("train", "val"):
        (tmp_path / "wds" / split).mkdir(parents=True)
        folder = ImageFolderDataset(learn_dataset, split)
        with webdataset.ShardWriter(str(tmp_path / "wds" / split / "p-%04d.tar"), maxcount=20, verbose=0) as sink:
            for index in range(len(folder)):
                sink.write({"__key__": f"s{index:05d}", "jpg": folder.read_encoded(index)[0],
                            "cls": int(folder.targets[index])})
    run_dir = tmp_path / "run"
    result = run_cli(["hardware=cpu", "dataset=shards", f"data.root={tmp_path / 'wds'}", "data.image_size=32",
                      "data.batch_size=16", "data.num_workers=2", "trainer.epochs=2", "trainer.progress=false",
                      f"dataset.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr
    assert read_metrics(run_dir)[-1]["val_acc"] >= 0.6
    said = result.stdout + result.stderr
    assert "dataset.shuffle_window=null: 30 shards shuffled together" in said and "(sorted by label)" in said
    assert "walks through the classes" not in said, "the default window mixes them: nothing to warn of"
