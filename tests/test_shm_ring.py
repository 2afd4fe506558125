"""The shared-memory batch ring (loadout/data/loader/ring.py): the same batches as the plain collate, never aliased, and
a slot is never rewritten before its batch was received, whatever DataLoader does."""

from __future__ import annotations

import pickle
import resource
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, SequentialSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision.transforms import v2

from loadout.data.fast.encoded import EncodedSample, slot_bytes
from loadout.data.loader.batch import Batch, WholeBatch, collate
from loadout.data.loader.plan import RING_SPARE_SLOTS, LoaderPlan
from loadout.data.loader.ring import ShmRing, build_collate
from loadout.data.loader.stateful import shutdown_workers
from loadout.data.loader.stream import EpochBatchSampler
from loadout.data.samples import BadSampleError, Samples
from loadout.data.seg_augment import JointCompose
from train.task.classification import Classification
from train.task.segmentation import Segmentation

SIZE, BATCH, EPOCHS = 8, 6, 3


class Pixels(Dataset):
    """Images whose every pixel depends on (index, the sample's seeded draw); every 7th index unreadable."""

    classes = [str(label) for label in range(5)]

    def __len__(self) -> int:
        return 45  # 7 full batches and a partial one per epoch

    def __getitem__(self, index: int):
        if index % 7 == 3:
            raise OSError(f"sample {index} is unreadable")
        base = torch.randint(0, 256, (3, SIZE, SIZE), dtype=torch.uint8)
        return base ^ index, index % 5


def unchanged(image: torch.Tensor) -> torch.Tensor:
    return image


def samples(source: Dataset, on_bad_sample: str = "warn") -> Samples:
    return Samples(source, unchanged, seed=3, on_bad_sample=on_bad_sample)


def loader(collate, *, workers: int = 2, in_order: bool = True, context=None, epochs: int = EPOCHS,
           prefetch: int = 2):
    batches = EpochBatchSampler(SequentialSampler(range(45)), BATCH, False, epochs)
    return StatefulDataLoader(samples(Pixels()), batch_sampler=batches,
                              collate_fn=collate, num_workers=workers, prefetch_factor=prefetch if workers else None,
                              persistent_workers=workers > 0, in_order=in_order, multiprocessing_context=context)


def ring(slots: int = 2) -> ShmRing:
    return ShmRing(2, slots, (BATCH, 3, SIZE, SIZE), torch.uint8)


def expected() -> list[Batch]:
    return list(loader(collate, workers=0))


def assert_same(got: list[Batch], want: list[Batch]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.bad == b.bad
        for x, y in ((a.images, b.images), (a.targets, b.targets), (a.indices, b.indices)):
            assert isinstance(x, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)


class WholeBatches(Dataset):
    """Batches as a source that reads them whole hands them over (`WholeBatch`: read_crops), or the same samples as
    a list; their images HWC in memory (channels_last) or not."""

    def __init__(self, whole: bool, channels_last: bool):
        self.whole, self.channels_last = whole, channels_last

    def __len__(self) -> int:
        return 45

    def __getitems__(self, indices: list[int]):
        images = torch.stack([torch.arange(3 * SIZE * SIZE).view(3, SIZE, SIZE).add(7 * i).to(torch.uint8)
                              for i in indices])
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        labels = [i % 5 for i in indices]
        if self.whole:
            return WholeBatch(images, torch.tensor(labels), torch.tensor(indices))
        return list(zip(images.unbind(0), labels, indices, strict=True))


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("fits", [True, False])
def test_a_whole_batch_arrives_as_the_batch_its_samples_make(channels_last, fits):
    """Through the ring's slot (or, not fitting it, the plain collate in a worker) and in the main process: the same
    images, layout, labels and indices, dtypes included, as the same samples one by one."""

    def batches(whole: bool, collate_fn, workers: int) -> list[Batch]:
        return list(StatefulDataLoader(WholeBatches(whole, channels_last), num_workers=workers,
                                       batch_sampler=BatchSampler(SequentialSampler(range(45)), BATCH, False),
                                       collate_fn=collate_fn))

    want = batches(False, collate, 0)
    shape = (BATCH, 3, SIZE, SIZE) if fits else (BATCH, 3, SIZE + 1, SIZE)
    for got in (batches(True, ShmRing(2, 2, shape, torch.uint8), 2), batches(True, collate, 0)):
        assert_same(got, want)
        assert all(b.images.is_contiguous(memory_format=torch.channels_last) == channels_last for b in got)


def test_ring_batches_equal_plain_batches_over_epochs_with_slots_reused():
    want = expected()
    assert len(want) == EPOCHS * 8 and sum(b.bad for b in want) > 0 and len(want[7]) < BATCH
    # slots = prefetch_factor, the least DataLoader's bound allows: each slot rewritten every other batch
    tight = ring(slots=2)
    assert_same(list(loader(tight)), want)
    assert int(tight.overruns) == 0
    assert_same(list(loader(collate)), want)


class HwcPixels(Pixels):
    """The same pixels laid out HWC in memory, as decoded JPEGs are."""

    def __getitem__(self, index: int):
        image, label = super().__getitem__(index)
        return image.permute(1, 2, 0).contiguous().permute(2, 0, 1), label


def test_hwc_images_go_through_the_ring_as_channels_last_batches_of_the_same_values():
    def hwc_loader(collate, workers: int = 2):
        batches = EpochBatchSampler(SequentialSampler(range(45)), BATCH, False, 1)
        return StatefulDataLoader(samples(HwcPixels()), batch_sampler=batches,
                                  collate_fn=collate, num_workers=workers, prefetch_factor=2 if workers else None)

    got, plain = list(hwc_loader(ring(slots=2))), list(hwc_loader(collate, workers=0))
    assert_same(got, expected()[:8])
    assert_same(plain, expected()[:8])
    assert all(b.images.is_contiguous(memory_format=torch.channels_last) for b in got + plain)


def test_a_consumer_holding_every_batch_sees_its_own_values():
    held = []
    for batch in loader(ring(slots=2)):
        held.append(batch)  # never freed: a batch aliasing its slot would show a later batch's pixels
    assert_same(held, expected())
    assert len({b.images.data_ptr() for b in held}) == len(held)


def test_out_of_order_batches_are_the_same_batches():
    def keys(batches):
        return sorted((b.indices.tolist(), b.targets.tolist(), b.bad, b.images.numpy().tobytes()) for b in batches)

    unordered = ring(slots=2)
    assert keys(loader(unordered, in_order=False)) == keys(expected())
    assert int(unordered.overruns) == 0


def test_resume_from_a_loader_state_gives_the_rest_through_the_ring():
    rings = ring(), ring()
    first = loader(rings[0])
    it = iter(first)
    head = [next(it) for _ in range(11)]
    state = first.state_dict()
    second = loader(rings[1])
    second.load_state_dict(state)
    assert_same(head + list(second), expected())
    assert [int(r.overruns) for r in rings] == [0, 0]


def slow(batches, pause_s: float = 0.5):
    """The batches, the consumer pausing after the first and every 8th: workers run as far ahead as DataLoader
    lets them."""
    for index, batch in enumerate(batches):
        if index % 8 == 0:
            time.sleep(pause_s)
        yield batch


@pytest.mark.parametrize("in_order", [True, False])
def test_dataloader_keeps_at_most_prefetch_factor_batches_per_worker_outstanding(in_order):
    """The bound the ring's slot count rests on (private DataLoader behaviour): with a slow consumer and workers
    running ahead, no worker ever finds its next slot unreceived. The day torch or torchdata changes it, this
    fails (the ring itself stays correct: see the next test)."""
    for prefetch in (1, 3):
        r = ShmRing(2, prefetch + RING_SPARE_SLOTS, (BATCH, 3, SIZE, SIZE), torch.uint8)
        got = list(slow(loader(r, in_order=in_order, prefetch=prefetch)))
        assert len(got) == len(expected())
        assert int(r.overruns) == 0, f"prefetch_factor={prefetch}: {int(r.overruns)} batches found their slot busy"


def test_a_slot_whose_batch_was_not_received_is_never_overwritten():
    """Too few slots for the loader's prefetch (1 slot, 4 batches ahead per worker): workers find their slot
    busy, take the plain collate for those batches, and every batch is still right."""
    r = ring(slots=1)
    assert_same(list(slow(loader(r, prefetch=4))), expected())
    assert int(r.overruns) > 0


@pytest.mark.slow
def test_spawn_workers_map_the_same_ring():
    assert_same(list(loader(ring(), context="spawn", epochs=1)), expected()[:8])


def test_batches_that_do_not_fit_and_the_main_process_use_the_plain_collate():
    small = ShmRing(2, 2, (BATCH, 3, SIZE // 2, SIZE // 2), torch.uint8)
    assert_same(list(loader(small, epochs=1)), expected()[:8])
    sample = [(torch.zeros(3, SIZE, SIZE, dtype=torch.uint8), 1)]
    batch = ring()(sample)  # outside a worker
    assert batch.images.shape == (1, 3, SIZE, SIZE) and batch.targets.tolist() == [1] and batch.bad == 0


class FaultCounting:
    """The ring's collate, with the worker's minor page faults during the call returned beside its batch."""

    def __init__(self, ring: ShmRing):
        self.ring = ring

    def __call__(self, batch: list):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = self.ring(batch)
        return out, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_workers_write_each_batch_once_into_a_slot_they_already_mapped():
    """Once a worker has touched its slots, collating a batch touches no fresh pages: no new shared-memory
    segment, no second stack of the images (a 3 x 192 x 192 batch of 8 spans 216 pages: a
    few pages of the allocator's own growth stay well under a quarter of it)."""
    class Big(Dataset):
        def __len__(self) -> int:
            return 8 * 24

        def __getitem__(self, index: int):
            return torch.full((3, 192, 192), index % 256, dtype=torch.uint8), index

    slots = 2
    counting = FaultCounting(ShmRing(1, slots, (8, 3, 192, 192), torch.uint8))
    batches = StatefulDataLoader(Big(), batch_size=8, collate_fn=counting, num_workers=1, prefetch_factor=slots)
    faults = []
    for index, (batch, count) in enumerate(batches):
        images, targets = batch.images, batch.targets
        assert torch.equal(images[:, 0, 0, 0], (targets % 256).to(torch.uint8)) and batch.bad == 0
        assert targets.tolist() == list(range(8 * index, 8 * index + 8))
        faults.append(count)
    page_count = 8 * 3 * 192 * 192 // resource.getpagesize()
    steady = faults[slots + 1:]
    assert max(steady) < page_count // 4, (faults, page_count)


def test_build_collate_sizes_the_ring_from_the_plan():
    plan = LoaderPlan(num_workers=3, batch_size=4, prefetch_factor=2, pin_memory=False, image_size=16,
                      dtype=torch.float32)
    assert build_collate(LoaderPlan(0, 4, 2, False, 16, torch.float32)) is collate
    built = build_collate(plan)
    assert built.buffers.shape == (3, 4, 4, 3, 16, 16) and built.buffers.dtype == torch.float32
    assert built.buffers.is_shared()
    assert pickle.loads(pickle.dumps(built)).token == built.token


class MaskedPixels(Pixels):
    """Pixels with a uint8 mask of their size drawn from the same seeded stream, its values class indices."""

    def __getitem__(self, index: int):
        image, _ = super().__getitem__(index)
        return image, (torch.randint(0, 256, (SIZE, SIZE), dtype=torch.uint8) ^ index) % len(self.classes)


def masked_loader(collate, workers: int = 2):
    batches = EpochBatchSampler(SequentialSampler(range(45)), BATCH, False, 2)
    pairs = Samples(MaskedPixels(), JointCompose([v2.RandomHorizontalFlip(p=0.0)]), seed=3)  # pairs unchanged
    return StatefulDataLoader(pairs, batch_sampler=batches, collate_fn=collate,
                              num_workers=workers, prefetch_factor=2 if workers else None,
                              persistent_workers=workers > 0)


def test_masks_go_through_their_own_ring_each_batch_its_own():
    plan = LoaderPlan(2, BATCH, 2, False, SIZE, torch.uint8, masks=True)
    assert plan.mask_shape == (BATCH, SIZE, SIZE)
    assert plan.shm_bytes > replace(plan, masks=False).shm_bytes
    masked = build_collate(plan)
    assert masked.masks.shape == (2, plan.ring_slots, BATCH, SIZE, SIZE) and masked.masks.is_shared()
    masked.masks.zero_()
    held = list(masked_loader(masked))  # every batch kept: one aliasing its slot would show a later one's masks
    assert_same(held, list(masked_loader(collate, workers=0)))
    assert all(b.targets.shape[1:] == (SIZE, SIZE) and b.targets.dtype == torch.uint8 for b in held)
    assert len({b.targets.data_ptr() for b in held}) == len(held) and int(masked.overruns) == 0
    in_ring = {masked.masks[w, s, :n].numpy().tobytes() for w in range(2) for s in range(plan.ring_slots)
               for n in range(1, BATCH + 1)}  # the slots hold each worker's last batches: they went through them
    assert sum(b.targets.numpy().tobytes() in in_ring for b in held) >= 2 * plan.ring_slots
    assert build_collate(replace(plan, masks=False)).masks is None
    assert plan.for_task(Segmentation(3)).masks and not plan.for_task(Classification()).masks


@pytest.mark.parametrize("workers", [2])
def test_a_failing_sample_still_raises_through_the_ring(workers):
    batches = EpochBatchSampler(SequentialSampler(range(45)), BATCH, False, 1)
    failing = StatefulDataLoader(samples(Pixels(), on_bad_sample="raise"), batch_sampler=batches, collate_fn=ring(),
                                 num_workers=workers, prefetch_factor=2, persistent_workers=True)
    try:
        with pytest.raises(BadSampleError, match="cannot read sample 3: sample 3 is unreadable"):
            list(failing)
    finally:  # the raise leaves workers mid-epoch: ended here, not by a later test's garbage collection
        shutdown_workers(failing)


class EncodedFiles(Dataset):
    """data.decode=device's samples: encoded files of 100-400 bytes, and one of 5,000 (index 13)."""

    def __len__(self) -> int:
        return 45

    def __getitem__(self, index: int):
        size = 5_000 if index == 13 else 100 + 50 * (index % 7)
        data = np.random.default_rng(index).integers(0, 256, size, dtype=np.uint8).tobytes()
        return EncodedSample(data, (index,) * 15), index % 5, index


def encoded_loader(collate, workers: int = 2, pin_memory: bool = False):
    return StatefulDataLoader(EncodedFiles(), batch_size=BATCH, collate_fn=collate, num_workers=workers,
                              prefetch_factor=2 if workers else None, pin_memory=pin_memory)


def encoded_ring(pin_memory: bool = False) -> ShmRing:
    """A ring with slots as data.decode=device sizes them from the files."""
    files = EncodedFiles()
    slot = slot_bytes([len(files[i][0].data) for i in range(len(files))], BATCH)
    assert sum(len(files[i][0].data) for i in range(12, 18)) > slot, "the outlier's batch does not fit"
    return ShmRing(2, RING_SPARE_SLOTS + 2, (slot,), torch.uint8, pin_memory=pin_memory)


def test_an_encoded_batch_larger_than_its_slot_takes_the_plain_collate_with_the_same_files():
    ring = encoded_ring()
    got, want = list(encoded_loader(ring)), list(encoded_loader(collate, workers=0))
    assert len(got) == len(want) == 8
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.targets, b.targets) and torch.equal(a.indices, b.indices)
        assert torch.equal(a.encoded.data, b.encoded.data) and np.array_equal(a.encoded.offsets, b.encoded.offsets)
        assert np.array_equal(a.encoded.geometry, b.encoded.geometry)
    assert int(ring.received.max()) > 0 and int(ring.overruns) == 0, "the other batches went through the ring"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA here (make gpu-check on a GPU)")
def test_encoded_files_cross_unpinned_beside_pinned_labels():
    """nvJPEG reads encoded files through host pointers: pinning them (a copy a batch, into page-locked blocks the
    caching allocator never returns) would only cost."""
    batches = list(encoded_loader(encoded_ring(pin_memory=True), pin_memory=True))
    assert len(batches) == 8
    assert all(b.targets.is_pinned() and not b.encoded.data.is_pinned() for b in batches)
