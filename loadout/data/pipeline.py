"""The data path: source -> Samples (seed, note, load/cache, transform, skip bad) -> sampler -> DataLoader (every
knob, one LoaderPlan) -> device prefetcher -> Batch on the device.

The training loop sees only `DataPipeline`: `train` and `val` both yield `Batch`es on the device through the same
prefetcher. `train` is a `TrainStream` (stream.py): one loader iterator spanning all epochs, so the workers
prefetch across epoch boundaries, with a state a checkpoint keeps; `positions(env)` gathers every rank's for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from loadout.build import fitted_spec, instantiate
from loadout.data.capabilities import Offers
from loadout.data.config import check_values
from loadout.data.fast.cache import SharedSampleCache
from loadout.data.fast.encoded import device_decoding
from loadout.data.loader.activity import ActivityBoard
from loadout.data.loader.batch import Batch
from loadout.data.loader.plan import LoaderPlan
from loadout.data.loader.positions import LoaderPositions
from loadout.data.loader.prefetcher import DevicePrefetcher
from loadout.data.loader.samplers import build_val_loader, explain_loader_error
from loadout.data.loader.shm import check_shm, warn_if_shm_too_small
from loadout.data.loader.stateful import shutdown_workers
from loadout.data.loader.stream import TrainStream, build_train_stream, train_loader
from loadout.data.masks import as_mask
from loadout.data.samples import Samples
from loadout.data.source import Source, check_sources, first_readable, sample_name
from loadout.data.transforms import resize_size
from loadout.dist import DistEnv
from loadout.errors import ConfigError


@dataclass(frozen=True)
class LoaderRecipe:
    """What both loaders are built from besides the plan, kept so that `DataPipeline.replan` rebuilds them."""

    data: object  # the `data:` section
    env: DistEnv
    seed: int
    to_device: Callable[..., Iterable]  # (batches, beside_workers=...); no reference back to the pipeline (build_data)

    def feed(self, plan: LoaderPlan) -> Callable[[Iterable], Iterable]:
        """The device prefetcher for `plan`: beside workers, a CPU batch is converted on one thread."""
        return partial(self.to_device, beside_workers=plan.num_workers > 0)


@dataclass
class DataPipeline:
    """`close()` (or `with`) ends the workers now; a pipeline simply dropped ends them as its last reference goes."""

    train: TrainStream  # this epoch's rest, on the device; its state_dict() is the position a checkpoint keeps
    val: DevicePrefetcher  # the validation loader's batches on the device; `.loader` is the StatefulDataLoader
    plan: LoaderPlan
    samples: tuple[Samples, Samples]  # (train, val): what their workers read, noted on one ActivityBoard
    recipe: LoaderRecipe | None = None  # None: the loaders cannot be rebuilt with another plan

    def replan(self, plan: LoaderPlan) -> None:
        """Both loaders rebuilt with `plan` (data.autotune, between epochs), the training stream at its position;
        what a sample is does not depend on the plan (samples.py seeds by (seed, epoch, index))."""
        recipe, (train, val) = self.recipe, self.samples
        shutdown_workers(self.val.loader)
        board = ActivityBoard(2 * plan.num_workers) if plan.num_workers else None
        train.board = val.board = board
        val.first_slot = plan.num_workers
        self.train.replace_loader(*train_loader(train, plan, recipe.data, recipe.env, recipe.seed, self.train.batches),
                                  recipe.feed(plan))
        self.val = recipe.feed(plan)(build_val_loader(val, plan, recipe.data, recipe.env, recipe.seed))
        self.plan = plan

    def positions(self, env: DistEnv) -> LoaderPositions:
        """The training position of every rank, the Stateful part a checkpoint keeps (loader/positions.py)."""
        return LoaderPositions(self.train, env)

    @property
    def loader_timeout(self) -> float:
        """Seconds a worker may take for one batch (0: forever): a collective should wait at least as long."""
        return self.val.loader.timeout

    @property
    def source(self) -> Source:
        """The training source: the task reads the model's output size from it (train/task/)."""
        return self.samples[0].source

    @property
    def num_classes(self) -> int:
        """The training source's class count (a source with `classes`)."""
        return len(self.source.classes)

    def set_epoch(self, epoch: int) -> None:
        """Position the training stream at `epoch` (the sampler's own set_epoch runs as its indices are drawn); a
        source told epochs hears it here too, so the main process names a stuck sample of this epoch."""
        self.train.set_epoch(epoch)
        source = self.samples[0].source
        if Offers.of(source).set_epoch:
            source.set_epoch(epoch)

    @property
    def part_names(self) -> tuple[str, ...] | None:
        """The sources a mixed training source draws from (dataset=mix), else None."""
        source = self.samples[0].source
        return tuple(source.parts) if Offers.of(source).parts else None

    def parts_of(self, epoch: int, indices) -> np.ndarray:
        """The part (a place in `part_names`) of each training index of `epoch`."""
        return self.samples[0].source.part_of(epoch, indices)

    def stuck_read(self) -> str | None:
        """The worker that has been reading one sample longest and that sample, for a timed-out loader's error."""
        train, val = self.samples
        found = None if train.board is None else train.board.longest_read()
        if found is None:
            return None
        slot, pid, index, seconds = found
        which, role = (train, "training") if slot < val.first_slot else (val, "validation")
        return (f"{role} worker {slot - which.first_slot} (pid {pid}) has been reading "
                f"{sample_name(which.source, index)} for {seconds:.0f} s")

    def explained(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """`batches`, with a dead worker or a timeout turned into a LoaderError naming its likely cause (for a
        timeout, the worker and the sample it is stuck on)."""
        iterator = iter(batches)
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except RuntimeError as err:
                explained = explain_loader_error(err, self.stuck_read())
                if explained is None:
                    raise
                raise explained from err
            yield batch

    def close(self) -> None:
        """End both loaders' worker processes now."""
        self.train.close()
        shutdown_workers(self.train.loader)
        shutdown_workers(self.val.loader)

    def __enter__(self) -> DataPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_sources(spec, data, task) -> tuple[Source, Source]:
    """`dataset._target_` built with split="train" and "val", checked (source.py) for what `task` trains on; a
    source that can decode at a smaller size gets the resize size when data.scaled_decode."""
    spec = fitted_spec("dataset", spec, optional=("root",))  # a class of your own may take no root
    train, val = (instantiate("dataset", spec, split=split) for split in ("train", "val"))
    check_sources(spec._target_, train, val, task)
    if data.scaled_decode and Offers.of(train).min_side:
        train.min_side = val.min_side = resize_size(data)
    return train, val


def _sample_cache(data, train: Source) -> SharedSampleCache | None:
    """The shared sample cache (data.cache_bytes), allocated in the main process before any worker starts."""
    if not data.cache_bytes:
        return None
    if Offers.of(train).ordered:
        raise ConfigError(f"data.cache_bytes={data.cache_bytes}: the sample cache keeps samples by index, and "
                          f"{type(train).__name__} reads other samples at an index each epoch: set it to 0")
    if Offers.of(train).decoded:
        raise ConfigError(f"data.cache_bytes={data.cache_bytes}: the sample cache is for datasets that decode "
                          f"({type(train).__name__} stores decoded images already): set it to 0")
    if as_mask(first_readable("dataset", train, train.__getitem__)[1][1]) is not None:
        raise ConfigError(f"data.cache_bytes={data.cache_bytes}: the sample cache keeps images alone, not their "
                          "masks: set it to 0 for segmentation")
    problem = check_shm(data.cache_bytes)
    if problem:
        raise ConfigError(f"data.cache_bytes={data.cache_bytes}: {problem}")
    return SharedSampleCache(len(train), resize_size(data), data.cache_bytes)


def build_data(data, sources: tuple[Source, Source], recipe, plan: LoaderPlan, env: DistEnv,
               device: torch.device, *, seed: int, epochs: int, channels_last: bool) -> DataPipeline:
    """Both loaders from the `data:` section, the sources, the augmentation recipe (its `train_transform` and
    `val_transform`: the template's augment recipes) and the plan; every check that can fail runs here, before any
    worker starts."""
    check_values(data)
    train, val = sources
    cache = _sample_cache(data, train)
    stored = Offers.of(train).size  # the side of square stored samples (packed): no Resize for them
    transforms = (recipe.train_transform(data, resize_size(data) if cache is not None else stored),
                  recipe.val_transform(data, stored))
    boxes, decoder = (None, None), None
    if data.decode == "device":
        boxes, plan, decoder = device_decoding(sources, transforms, plan, device)
    board = ActivityBoard(2 * plan.num_workers) if plan.num_workers else None
    common = dict(seed=seed, on_bad_sample=data.on_bad_sample, board=board)
    samples = (Samples(train, transforms[0], cache=cache, encoded=boxes[0], **common),
               Samples(val, transforms[1], first_slot=plan.num_workers, encoded=boxes[1], **common))
    warn_if_shm_too_small(plan.shm_bytes)
    val_loader = build_val_loader(samples[1], plan, data, env, seed)
    # no reference back to the pipeline: the stream holds this, and a cycle would leave its workers to the collector
    recipe = LoaderRecipe(data, env, seed, partial(DevicePrefetcher, device=device, normalize=data.device_transforms,
                                                   channels_last=channels_last, non_blocking=data.non_blocking,
                                                   decoder=decoder))
    train_stream = build_train_stream(samples[0], plan, data, env, seed=seed, epochs=epochs,
                                      to_device=recipe.feed(plan))
    return DataPipeline(train_stream, recipe.feed(plan)(val_loader), plan, samples, recipe)

