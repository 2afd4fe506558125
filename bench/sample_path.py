#!/usr/bin/env python3
"""Where one sample's CPU time goes between its file and the uint8 batch, stage by stage (issue 36, item 3): the
read, the crop's box drawn from the header, the decode at the chosen DCT scale, the crop, the resize, each of the
pipeline's later steps (the flip), the stack into a shared-memory ring slot, and the main process's copy out of it.
Three sets: real photos (scripts/make_photos.py) under augment=imagenet at 224 px (RandomResizedCrop, crop-aware
decode), the same with data.scaled_decode=false (decoded whole, then the pipeline's RandomResizedCrop) and the default
path (data/synthetic, augment=crop_flip at 64 px: decode, Resize, RandomCrop, flip).

One process, one thread, the real functions of loadout's path (decode.py, samples.py, batch.py, ring.py) called
one stage at a time, each sample seeded as a worker seeds it. Times are this thread's CPU time (`thread_time`), so
other jobs on a shared machine slow them less than wall time; each stage's figure is its best of ROUNDS passes.
"Whole path" is `Samples.__getitems__` + the ring on the same batches (the stages plus seeding and bookkeeping).
On the photos, on both paths, three ways to crop + resize the same decodes with the same boxes are timed in turn: v2's
own (F.resized_crop: a strided view of the decoder's rows handed to torchvision), loadout's (decode.crop_resize: the
rows copied into their own block first, same pixels), and Pillow's `resize(box=)` on the decoded array (the other
resizer loadout already depends on).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from common import DATA, ROOT, machine, pipeline
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from loadout.data.fast.decode import crop_block, crop_resize, decode_for_box, decode_image_file, decoded_box
from loadout.data.loader.batch import channels_innermost, stack_images
from loadout.data.loader.ring import ShmRing
from loadout.data.samples import Samples
from loadout.data.seeds import sample_seeds

REAL_DATA = Path(os.environ.get("REAL_DATA", ROOT / "data" / "photos-500"))
BATCH, BATCHES, ROUNDS = 64, 6, 3
IMAGENET = ("dataset=imagefolder", "augment=imagenet", "data.image_size=224")
SETS = {"photos-500, augment=imagenet, 224 px": (REAL_DATA, IMAGENET),
        "the same, data.scaled_decode=false (decoded whole, then RandomResizedCrop)":
        (REAL_DATA, (*IMAGENET, "data.scaled_decode=false")),
        "synthetic, augment=crop_flip, 64 px (the default)": (DATA, ())}


class Laps:
    """Per-stage CPU time of this thread: `lap(name)` charges the time since the previous lap to `name`."""

    def __init__(self):
        self.ns: dict[str, int] = defaultdict(int)
        self.last = time.thread_time_ns()

    def lap(self, name: str) -> None:
        now = time.thread_time_ns()
        self.ns[name] += now - self.last
        self.last = now


def seeds(samples: Samples, indices: range) -> list[int]:
    """The seeds a worker gives torch's CPU generator for the samples (epoch 0, index), drawn a batch at a time."""
    return (sample_seeds(samples.seed, np.zeros(len(indices), dtype=np.int64), np.array(indices))
            >> np.uint64(1)).tolist()


def one_sample(samples: Samples, index: int, seed: int, names: list[str], laps: Laps) -> torch.Tensor:
    """The sample's image through the stages, each lapped."""
    source, first = samples.source, samples.crop_first
    torch.default_generator.manual_seed(seed)
    laps.lap("seeding")
    data, _ = source.read_encoded(index)
    laps.lap("read the file")
    if first is None:  # the whole image decoded (DCT-scaled to the resize size), then every step
        image, steps = decode_image_file(data, source.min_side), samples.transform.direct_steps
        laps.lap("decode")
    else:
        box = samples.stored_box(data)
        laps.lap("crop box from the header")
        image, stored = decode_for_box(data, box, tuple(first.crop.size))
        laps.lap("decode")
        block = crop_block(image, decoded_box(image, stored, box))  # decode.crop_resize, one stage at a time
        laps.lap("crop (rows copied into a block)")
        image, steps = F.resize(block, list(first.crop.size), interpolation=first.crop.interpolation,
                                antialias=first.crop.antialias), first.rest
        laps.lap("resize (torchvision uint8, on the block)")
    for name, step in zip(names, steps, strict=True):
        image = step(image)
        laps.lap(name)
    return image


def resized_crop(samples: Samples):
    """The pipeline's RandomResizedCrop where it runs on the CPU (crop-aware decode or after a whole decode), else
    None."""
    first = samples.crop_first.crop if samples.crop_first is not None else samples.transform.transforms[0]
    return first if type(first) is v2.RandomResizedCrop else None


def crop_resize_ways(samples: Samples, index: int) -> tuple[list[int], list[torch.Tensor]]:
    """CPU ns of each way in WAYS to crop + resize one sample's decode (as its path decodes it, with its box), and
    their outputs."""
    crop = resized_crop(samples)
    torch.default_generator.manual_seed(seeds(samples, range(index, index + 1))[0])
    data, _ = samples.source.read_encoded(index)
    if samples.crop_first is not None:
        stored_box = samples.stored_box(data)
        image, stored = decode_for_box(data, stored_box, tuple(crop.size))
        box = decoded_box(image, stored, stored_box)
    else:
        image = decode_image_file(data, samples.source.min_side)
        params = crop.make_params([image])
        box = (params["top"], params["left"], params["height"], params["width"])
    size, how = list(crop.size), dict(interpolation=crop.interpolation, antialias=crop.antialias)
    times, outputs = [], []
    for way in WAYS.values():
        start = time.thread_time_ns()
        outputs.append(way(image, box, size, how))
        times.append(time.thread_time_ns() - start)
    return times, outputs


def pillow_resize(image, box, size, how) -> torch.Tensor:
    """Pillow's resize of the box (its `box=` argument), bilinear with its own antialiasing; back to a tensor HWC in
    memory."""
    top, left, height, width = box
    picture = Image.fromarray(image.permute(1, 2, 0).numpy())
    out = picture.resize(size[::-1], Image.Resampling.BILINEAR, box=(left, top, left + width, top + height))
    return torch.from_numpy(np.array(out)).permute(2, 0, 1)


WAYS = {  # crop + resize, v2's own first (F.resized_crop: a strided view of the decoder's rows, then the resize)
    "strided view + torchvision (v2)": lambda image, box, size, how: F.resized_crop(image, *box, size, **how),
    "block copy + torchvision": lambda image, box, size, how: crop_resize(image, box, size, **how),
    "Pillow resize(box=)": pillow_resize,
}


def one_pass(samples: Samples, ring: ShmRing, names: list[str]) -> dict[str, int]:
    laps = Laps()
    for batch in range(BATCHES):
        indices = range(batch * BATCH, (batch + 1) * BATCH)
        laps.last = time.thread_time_ns()
        batch_seeds = seeds(samples, indices)
        laps.lap("seeding")
        images = [one_sample(samples, index, seed, names, laps)
                  for index, seed in zip(indices, batch_seeds, strict=True)]
        slot = ring.buffers[0, batch % ring.slots]
        stack_images(images, slot)
        laps.lap("stack into the ring slot")
        ring.copy_out(0, batch, BATCH, channels_innermost(images[0]))
        laps.lap("copy out of the ring (main process)")
    return laps.ns


def whole_pass(samples: Samples, ring: ShmRing) -> int:
    """CPU ns of Samples.__getitems__ + the ring's stack and copy-out over the same batches."""
    start = time.thread_time_ns()
    for batch in range(BATCHES):
        images = [sample[0] for sample in samples.__getitems__([(0, i) for i in range(batch * BATCH,
                                                                                      (batch + 1) * BATCH)])]
        stack_images(images, ring.buffers[0, batch % ring.slots])
        ring.copy_out(0, batch, BATCH, channels_innermost(images[0]))
    return time.thread_time_ns() - start


def measure(title: str, root: Path, overrides: tuple[str, ...]) -> None:
    with pipeline(*overrides, "data.num_workers=0", f"data.batch_size={BATCH}", root=root) as data:
        samples = data.samples[0]
        if len(samples) < BATCH * BATCHES:
            raise SystemExit(f"{root}: {len(samples)} samples, {BATCH * BATCHES} needed (`make bench` makes them)")
        steps = samples.transform.transforms
        names = [type(step).__name__ for step in (steps[1:] if samples.crop_first else steps)]
        shape = tuple(samples[0][0].shape)
        ring = ShmRing(1, 2, (BATCH, *shape), torch.uint8)
        best: dict[str, float] = {}
        whole = float("inf")
        for _ in range(ROUNDS):
            for name, ns in one_pass(samples, ring, names).items():
                best[name] = min(best.get(name, float("inf")), ns)
            whole = min(whole, whole_pass(samples, ring))
        count = BATCH * BATCHES
        total = sum(best.values())
        print(f"{title}: {count} samples, {shape[-1]} px out; CPU us a sample (best of {ROUNDS}), share of the stages")
        for name, ns in best.items():
            print(f"  {name:42s} {ns / count / 1e3:7.1f} us  {100 * ns / total:5.1f} %")
        print(f"  {'sum of the stages':42s} {total / count / 1e3:7.1f} us  ({count * 1e9 / total:.0f} img/s a core)")
        print(f"  {'whole path (Samples + ring)':42s} {whole / count / 1e3:7.1f} us  ({count * 1e9 / whole:.0f} img/s "
              f"a core)")
        if resized_crop(samples) is not None:
            runs = [crop_resize_ways(samples, index) for index in range(count) for _ in range(ROUNDS)]
            best_ns = [min(sum(run[0][k] for run in runs[r::ROUNDS]) for r in range(ROUNDS)) for k in range(len(WAYS))]
            equal = all(torch.equal(view, block) for _, (view, block, _) in runs)
            pil_diff = max((block.float() - pil.float()).abs().mean().item() for _, (_, block, pil) in runs)
            print("  crop + resize, same decodes: " + ", ".join(
                f"{name} {ns / count / 1e3:.1f} us" for name, ns in zip(WAYS, best_ns, strict=True))
                + f"; strided / block {best_ns[0] / best_ns[1]:.2f}x (pixels {'equal' if equal else 'DIFFER'}), "
                f"Pillow / block {best_ns[2] / best_ns[1]:.2f}x (mean |difference| <= {pil_diff:.2f})")

if __name__ == "__main__":
    torch.set_num_threads(1)  # as a worker runs
    for title, (root, overrides) in SETS.items():
        measure(title, root, overrides)
    print(f"  {machine()}", flush=True)
