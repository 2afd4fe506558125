"""The data path end to end with real workers and real JPEG decoding: seeding, epochs across persistent workers,
the multi-epoch stream and its resume position, the packed format, the shared cache, corrupt files, and the
device-side normalization."""

from __future__ import annotations

import gc
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from loadout.data.datasets import Cifar10Dataset, ImageFolderDataset
from loadout.data.fast.cache import SharedSampleCache
from loadout.data.fast.packed import PackedDataset
from loadout.data.loader.plan import LoaderPlan
from loadout.data.loader.samplers import build_sampler
from loadout.data.loader.stream import EpochBatchSampler, build_train_stream
from loadout.data.loader.workers import init_worker
from loadout.data.samples import Samples
from loadout.data.seeds import loader_seed, sample_seed, sample_seeds
from loadout.data.transforms import MEAN, STD, DeviceNormalize, DirectCompose, fit_square
from loadout.dist import DistEnv
from loadout.errors import ConfigError
from scripts.pack_dataset import pack_split
from tests.conftest import ROOT, compose_config, read_metrics, run_cli
from train.job import data_from_config

CPU = torch.device("cpu")


def data_cfg(root: Path, *extra: str):
    return compose_config(["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16",
                           "trainer.epochs=2", *extra])


def epoch_batches(pipeline, epoch: int) -> list:
    pipeline.set_epoch(epoch)
    return [(batch.images.clone(), batch.targets.clone(), batch.bad) for batch in pipeline.train]


def same(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True))


# -- seeding ---------------------------------------------------------------------------------------------------
class WorkerProbe(Dataset):
    """What each worker's own RNGs give: (random, numpy, torch, worker id) for one sample."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        info = torch.utils.data.get_worker_info()
        return torch.tensor([random.random(), float(np.random.rand()), float(torch.rand(1)), float(info.id)],
                            dtype=torch.float64)


def worker_draws(seed: int, rank: int) -> dict[int, tuple]:
    loader = DataLoader(WorkerProbe(), batch_size=1, num_workers=2, worker_init_fn=init_worker,
                        generator=torch.Generator().manual_seed(loader_seed(seed, rank)))
    draws = {}
    for (row,) in loader:
        draws.setdefault(int(row[3]), tuple(row[:3].tolist()))
    return draws


def test_worker_rngs_distinct_across_workers_and_ranks_and_reproducible():
    rank0, rank1 = worker_draws(0, 0), worker_draws(0, 1)
    streams = list(rank0.values()) + list(rank1.values())
    for lib in range(3):  # random, numpy, torch: no two (rank, worker) pairs share a stream
        assert len({s[lib] for s in streams}) == 4
    assert worker_draws(0, 0) == rank0
    assert worker_draws(1, 0) != rank0


class ThreadProbe:
    """A source whose samples hold the torch intra-op threads they were loaded with."""

    classes = ["probe"]

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        return torch.full((3, 1, 1), torch.get_num_threads(), dtype=torch.uint8), 0


def threads_and_a_draw(image: torch.Tensor) -> torch.Tensor:
    """A transform: the probe's thread count and a draw from torch's RNG."""
    return torch.tensor([float(image[0, 0, 0]), float(torch.rand(1))], dtype=torch.float64)


def test_without_workers_samples_load_on_one_thread_and_leave_the_main_process_threads_and_rng_alone():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        torch.manual_seed(0)
        expected_draw = torch.rand(1)
        torch.manual_seed(0)
        keys = [(0, index) for index in range(8)]
        samples = Samples(ThreadProbe(), threads_and_a_draw, seed=0)
        rows = torch.cat([rows for rows, _, _ in DataLoader(samples, sampler=keys, batch_size=4,
                                                            generator=torch.Generator().manual_seed(0))])
        assert rows[:, 0].tolist() == [1.0] * 8  # as in a DataLoader worker
        assert len(set(rows[:, 1].tolist())) == 8  # each sample drew from its own seed
        assert torch.get_num_threads() == 2 and torch.equal(torch.rand(1), expected_draw)
    finally:
        torch.set_num_threads(threads)


def test_same_seed_same_batches_whatever_the_workers_and_distinct_across_ranks(tiny_dataset):
    env = DistEnv()
    a = epoch_batches(data_from_config(data_cfg(tiny_dataset, "data.num_workers=0"), env, CPU), 0)
    b = epoch_batches(data_from_config(data_cfg(tiny_dataset, "data.num_workers=2"), env, CPU), 0)
    c = epoch_batches(data_from_config(data_cfg(tiny_dataset, "data.num_workers=2", "trainer.seed=1"), env, CPU), 0)
    assert same(a, b)
    assert not same(a, c)
    ranks = [epoch_batches(data_from_config(data_cfg(tiny_dataset, "data.num_workers=0"), DistEnv(rank=r, world_size=2),
                                      CPU), 0) for r in (0, 1)]
    assert not any(torch.equal(x[0], y[0]) for x, y in zip(*ranks, strict=True))


@pytest.mark.slow
def test_spawned_workers_get_the_pipeline_by_pickle_and_give_the_forked_workers_batches(tiny_dataset):
    """data.multiprocessing_context=spawn pickles the samples, transforms and all, into each worker."""
    env = DistEnv()
    forked = epoch_batches(data_from_config(data_cfg(tiny_dataset, "data.num_workers=2"), env, CPU), 0)
    spawned = epoch_batches(data_from_config(data_cfg(tiny_dataset, "data.num_workers=2",
                                                      "data.multiprocessing_context=spawn"), env, CPU), 0)
    assert same(forked, spawned)


# -- epochs under persistent workers, the stream and its position ----------------------------------------------
class Curriculum(Dataset):
    """An epoch-aware source: each sample's pixels are (the epoch its worker's copy believes it is in, index)."""

    classes = ["only"]

    def __init__(self):
        self.epoch = 0
        self.targets = np.zeros(32, dtype=np.int64)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int):
        return torch.tensor([self.epoch, index], dtype=torch.uint8).expand(3, 1, 2), self.epoch


def test_epoch_reaches_persistent_workers_even_when_prefetched_across_the_boundary(tiny_dataset):
    cfg = data_cfg(tiny_dataset, "data.num_workers=2", "data.batch_size=4", "data.prefetch_factor=4")
    plan = LoaderPlan.from_config(cfg.data, DistEnv(), CPU)
    samples = Samples(Curriculum(), lambda image: image, seed=0)
    stream = build_train_stream(samples, plan, cfg.data, DistEnv(), seed=0, epochs=3, to_device=iter)
    orders = []
    for epoch in range(3):
        stream.set_epoch(epoch)
        batches = list(stream)
        assert len(batches) == 8
        assert all((batch.targets == epoch).all() for batch in batches)
        indices = torch.cat([batch.images[:, 0, 0, 1] for batch in batches]).tolist()
        assert sorted(indices) == list(range(32))  # every sample once per epoch
        orders.append(indices)
    assert orders[0] != orders[1] != orders[2]  # the sampler's epoch changes the order


@pytest.mark.parametrize("end", ["close", "drop"])
def test_persistent_workers_end_promptly_on_close_or_when_the_pipeline_is_dropped(tiny_dataset, end):
    """Nothing in the pipeline refers back to it, so dropping it ends its workers at once: a reference cycle would
    leave them to the garbage collector, which finalizes the index queues first and makes each worker wait out
    DataLoader's 5 s join timeout before it is killed."""
    before = {child.pid for child in psutil.Process().children()}
    pipeline = data_from_config(data_cfg(tiny_dataset, "data.num_workers=2"), DistEnv(), CPU)
    epoch_batches(pipeline, 0)
    next(iter(pipeline.val))
    workers = [child for child in psutil.Process().children() if child.pid not in before]
    assert len(workers) == 4  # two training and two validation workers, persistent
    gc.disable()
    try:
        if end == "close":
            pipeline.close()
        else:
            del pipeline
        _, alive = psutil.wait_procs(workers, timeout=3)
    finally:
        gc.enable()
    assert not alive, f"workers {[child.pid for child in alive]} still running 3 s after the pipeline's {end}"


def test_batches_never_span_epochs_and_drop_last_is_per_epoch():
    sampler = EpochBatchSampler(range(10), batch_size=4, drop_last=True, epochs=2)
    assert [[e for e, _ in b][0] for b in sampler] == [0, 0, 1, 1]
    sampler = EpochBatchSampler(range(10), batch_size=4, drop_last=False, epochs=2)
    assert [len(b) for b in sampler] == [4, 4, 2, 4, 4, 2]
    sampler.start_epoch, sampler.start_batch = 1, 2
    assert list(sampler) == [[(1, 8), (1, 9)]] and len(sampler) == 1


def test_resume_mid_epoch_gives_exactly_the_remaining_batches(tiny_dataset):
    cfg = data_cfg(tiny_dataset, "data.num_workers=2")
    whole = data_from_config(cfg, DistEnv(), CPU)
    reference = epoch_batches(whole, 0) + epoch_batches(whole, 1)
    per_epoch = len(whole.train)
    first = data_from_config(cfg, DistEnv(), CPU)
    first.set_epoch(1)
    it = iter(first.train)
    for _ in range(5):
        next(it)
    state = first.train.state_dict()
    assert (state["epoch"], state["batch"]) == (1, 5)
    resumed = data_from_config(cfg, DistEnv(), CPU)
    resumed.set_epoch(1)
    resumed.train.load_state_dict(state)
    assert same(epoch_batches(resumed, 1), reference[per_epoch + 5:])


def test_weighted_and_random_samplers_draw_the_same_order_for_the_same_epoch(tiny_dataset):
    dataset = ImageFolderDataset(tiny_dataset / "train")
    for kind in ("random", "weighted"):
        cfg = data_cfg(tiny_dataset, f"data.sampler={kind}")
        a, b = (build_sampler(dataset, cfg.data, DistEnv(), True, 0) for _ in range(2))
        a.set_epoch(3)
        list(a)
        a.set_epoch(4)
        b.set_epoch(4)
        assert list(a) == list(b)
        b.set_epoch(5)
        assert list(a) != list(b)


# -- packed format ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_pack_round_trip_equals_the_decoded_pixels(tiny_dataset, tmp_path):
    out = tmp_path / "packed"
    subprocess.run([sys.executable, "scripts/pack_dataset.py", str(tiny_dataset), str(out), "--size", "37"],
                   cwd=ROOT, check=True, capture_output=True)
    source = ImageFolderDataset(tiny_dataset / "train")
    packed = PackedDataset(out / "train")
    assert packed.classes == source.classes and np.array_equal(packed.targets, source.targets)
    for index in (0, 17, len(source) - 1):
        assert torch.equal(packed[index][0], fit_square(source[index][0], 37))
    cfg = data_cfg(out, "dataset=packed", "data.num_workers=2")
    batches = epoch_batches(data_from_config(cfg, DistEnv(), CPU), 0)
    assert batches[0][0].shape == (16, 3, 32, 32)


@pytest.mark.slow
def test_pack_cifar10_round_trip_keeps_every_pixel_and_label(cifar_root, tmp_path):
    out = tmp_path / "cifar-packed"
    subprocess.run([sys.executable, "scripts/pack_dataset.py", str(cifar_root), str(out), "--size", "32"],
                   cwd=ROOT, check=True, capture_output=True)
    for split in ("train", "val"):
        source, packed = Cifar10Dataset(cifar_root, split), PackedDataset(out, split)
        assert packed.classes == source.classes and np.array_equal(packed.targets, source.targets)
        assert np.array_equal(packed.images, source.images)  # 32 px stored at 32 px: no resize, no crop


def test_packed_augmentation_is_vectorised_per_batch_and_a_function_of_seed_epoch_and_index(tiny_dataset, tmp_path):
    """Packed training batches: each sample a 32 px window of its stored 37 px image, flipped or not, drawn from
    (seed, epoch, index) alone, so any batching, order or worker count gives the same pixels."""
    out = tmp_path / "packed"
    for split in ("train", "val"):
        pack_split(ImageFolderDataset(tiny_dataset, split, min_side=37), out / split, 37)
    packed = PackedDataset(out / "train")
    dataset = Samples(packed, DirectCompose([v2.RandomCrop(32), v2.RandomHorizontalFlip()]), seed=0)
    assert dataset.crops is not None  # whole batches through read_crops
    keys = [(0, i) for i in range(len(dataset))]
    whole = dataset.__getitems__(keys)
    shuffled = dataset.__getitems__(keys[::-3])
    for (image, target, index), (again, target2, index2) in zip(whole[::-3], shuffled, strict=True):
        assert torch.equal(image, again) and target == target2 and index == index2
    assert torch.equal(dataset[(0, 7)][0], whole[7][0])
    flips = 0
    for index in range(0, len(dataset), 10):
        image, stored = whole[index][0], packed[index][0]
        assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
        windows = stored.unfold(1, 32, 1).unfold(2, 32, 1).permute(1, 2, 0, 3, 4).reshape(-1, 3, 32, 32)
        plain = any(torch.equal(image, w) for w in windows)
        flipped = any(torch.equal(image.flip(-1), w) for w in windows)
        assert plain or flipped
        flips += flipped and not plain
    assert 5 <= flips <= 19  # p = 0.5 over 24 samples
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(whole, dataset.__getitems__([(1, i) for i, _ in keys]),
                                                             strict=True))
    cfgs = [data_cfg(out, "dataset=packed", f"data.num_workers={w}") for w in (0, 2)]
    a, b = (epoch_batches(data_from_config(cfg, DistEnv(), CPU), 0) for cfg in cfgs)
    assert same(a, b)


def test_sample_seeds_vectorised_equal_scalar_and_distinct():
    epochs, indices = np.repeat(np.arange(3), 1000), np.tile(np.arange(1000), 3)
    seeds = sample_seeds(0, epochs, indices)
    assert seeds.dtype == np.uint64 and len(set(seeds.tolist())) == 3000
    assert sample_seed(0, 2, 17) == int(seeds[2017]) >> 1
    assert not np.array_equal(sample_seeds(1, epochs, indices), seeds)
    assert 0.45 < float(np.mean(seeds & np.uint64(1))) < 0.55


def test_direct_compose_draws_and_pixels_equal_v2():
    steps = [v2.Resize(37, antialias=True), v2.RandomCrop(32), v2.RandomHorizontalFlip(p=0.3),
             v2.ToDtype(torch.float32, scale=True), v2.Normalize((0.4, 0.5, 0.6), (0.2, 0.3, 0.2))]
    reference, direct = v2.Compose(steps), DirectCompose(steps)
    for seed in range(50):
        image = torch.randint(0, 256, (3, 40 + seed % 7, 48 - seed % 5), dtype=torch.uint8)
        torch.manual_seed(seed)
        expected, next_draw = reference(image), torch.rand(1)
        torch.manual_seed(seed)
        assert torch.equal(direct(image), expected) and torch.equal(torch.rand(1), next_draw)


# -- shared cache ----------------------------------------------------------------------------------------------
def test_cache_stays_within_its_bound_and_is_filled_by_the_workers(tiny_dataset):
    size = round(32 * 256 / 224)
    bound = 100 * 3 * size * size  # room for fewer than the 240 training images
    cfg = data_cfg(tiny_dataset, f"data.cache_bytes={bound}", "data.num_workers=2")
    pipeline = data_from_config(cfg, DistEnv(), CPU)
    cache = pipeline.samples[0].cache
    assert cache.nbytes <= bound and cache.capacity == bound // (3 * size * size + 9)
    epoch0 = epoch_batches(pipeline, 0)
    assert len(cache) == cache.capacity  # the workers' writes are visible here: one slab, shared
    uncached = epoch_batches(data_from_config(data_cfg(tiny_dataset, "data.num_workers=0"), DistEnv(), CPU), 0)
    assert same(epoch0, uncached)  # square images at the resize size: the same crops as decoding each time
    rerun = data_from_config(cfg, DistEnv(), CPU)
    rerun.train.loader.dataset.cache = cache  # a filled cache: hits give the same pixels
    assert same(epoch_batches(rerun, 0), epoch0)


def test_cache_returns_copies():
    cache = SharedSampleCache(4, 8, 10**6)
    image, label = cache.fetch(1, lambda i: (torch.full((3, 10, 12), 7, dtype=torch.uint8), 3))
    assert image.shape == (3, 8, 8) and label == 3 and cache.filled.tolist() == [0, 1, 0, 0]
    cache.fetch(1, None)[0].zero_()
    assert int(cache.fetch(1, None)[0].min()) == 7 and cache.fetch(1, None)[1] == 3


def test_cache_is_for_datasets_that_decode(cifar_root):
    with pytest.raises(ConfigError, match="data.cache_bytes=1000: the sample cache is for datasets that decode"):
        data_from_config(data_cfg(cifar_root, "dataset=cifar10", "data.cache_bytes=1000"), DistEnv(), CPU)


# -- corrupt files ---------------------------------------------------------------------------------------------
@pytest.fixture
def corrupt_dataset(tiny_dataset, tmp_path) -> tuple[Path, Path]:
    root = tmp_path / "corrupt"
    shutil.copytree(tiny_dataset, root)
    bad = root / "train" / "square" / "00003.jpg"
    bad.write_bytes(b"not a jpeg at all")
    return root, bad


@pytest.mark.slow
def test_corrupt_file_is_skipped_named_and_counted(corrupt_dataset, tmp_path):
    root, bad = corrupt_dataset
    run_dir = tmp_path / "run"
    result = run_cli(["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16",
                      "data.num_workers=2", "trainer.epochs=2", "trainer.progress=false", "model.name=resnet18",
                      f"hydra.run.dir={run_dir}"])
    assert result.returncode == 0, result.stderr
    logs = "".join(path.read_text() for path in run_dir.glob("*.log"))
    assert str(bad) in result.stdout + result.stderr + logs
    assert [r["bad_samples"] for r in read_metrics(run_dir)] == [1, 1]


@pytest.mark.slow
def test_corrupt_file_raises_under_on_bad_sample_raise(corrupt_dataset, tmp_path):
    root, bad = corrupt_dataset
    result = run_cli(["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16",
                      "data.num_workers=2", "data.on_bad_sample=raise", "trainer.epochs=1", "trainer.progress=false",
                      f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode == 2
    assert f"cannot read {bad}" in result.stderr and "data.on_bad_sample=warn" in result.stderr


# -- device transforms -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("channels_last", [False, True])
def test_decoded_jpeg_batches_travel_channels_last_and_reach_the_model_in_its_layout(tiny_dataset, workers,
                                                                                     channels_last):
    """Decoded JPEGs are HWC in memory: the loader stacks them as channels_last batches (a row copy, not a
    transposing one), equal to a plain NCHW stack; the device side hands the model the layout it asked for."""
    cfg = data_cfg(tiny_dataset, f"data.num_workers={workers}", f"trainer.channels_last={channels_last}")
    if workers == 0:
        cfg.data.prefetch_factor = None
        cfg.data.persistent_workers = False
    data = data_from_config(cfg, DistEnv(), CPU)
    dataset = data.val.loader.dataset
    host = next(iter(data.val.loader))
    images = host.images
    assert images.dtype == torch.uint8 and images.is_contiguous(memory_format=torch.channels_last)
    plain = torch.stack([dataset[i][0].contiguous() for i in range(images.shape[0])])
    assert torch.equal(images, plain)
    on_device = next(iter(data.val)).images
    layout = torch.channels_last if channels_last else torch.contiguous_format
    assert on_device.dtype == torch.float32 and on_device.is_contiguous(memory_format=layout)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD).view(1, 3, 1, 1) * 255
    torch.testing.assert_close(on_device, (plain.float() - mean) / std)


def test_device_normalize_matches_worker_normalize(tiny_dataset):
    on_device = epoch_batches(data_from_config(data_cfg(tiny_dataset, "data.device_transforms=true"), DistEnv(), CPU),
                              0)
    in_workers = epoch_batches(data_from_config(data_cfg(tiny_dataset, "data.device_transforms=false"), DistEnv(),
                                                CPU), 0)
    assert on_device[0][0].dtype == torch.float32 and in_workers[0][0].dtype == torch.float32
    for a, b in zip(on_device, in_workers, strict=True):
        torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(a[1], b[1])


@pytest.mark.parametrize("shape", [(4, 3, 24, 40), (1, 3, 1, 7), (2, 3, 5, 1), (3, 3, 120, 224)])  # the last: 4 slabs
def test_a_channels_last_batch_normalizes_to_the_same_bits_as_the_plain_broadcast(shape):
    """The pixel-line path (NHWC memory as rows) against (x - mean) / std broadcast over the batch as it comes."""
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    normalize = DeviceNormalize(CPU)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1) * 255, torch.tensor(STD).view(1, 3, 1, 1) * 255
    for layout in (torch.channels_last, torch.contiguous_format):
        batch = images.contiguous(memory_format=layout)
        out = normalize(batch)
        assert out.dtype == torch.float32 and out.is_contiguous(memory_format=layout)
        assert torch.equal(out, batch.float().sub_(mean).div_(std))


class ThreadsSeen(TorchFunctionMode):
    """The torch thread counts in force at the normalization's calls (float, sub_, div_) made inside the mode."""

    def __init__(self):
        super().__init__()
        self.seen: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("float", "sub_", "div_"):
            self.seen.add(torch.get_num_threads())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("workers", [0, 2])
def test_beside_workers_cpu_batches_convert_on_one_thread_and_the_loop_keeps_its_threads(tiny_dataset, workers):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with data_from_config(data_cfg(tiny_dataset, f"data.num_workers={workers}"), DistEnv(), CPU) as data:
            batches = iter(data.val)
            with ThreadsSeen() as seen:
                images = next(batches).images
            assert images.dtype == torch.float32 and torch.get_num_threads() == 2
        assert seen.seen == ({1} if workers else {2})
    finally:
        torch.set_num_threads(threads)
