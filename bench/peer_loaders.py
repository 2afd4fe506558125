#!/usr/bin/env python3
"""The peers of `make bench-peers` (bench/peers.py), each built as its own documentation builds it, on one recipe:
RandomResizedCrop 224 (scale 0.08-1, aspect 3/4-4/3) + horizontal flip, uint8 batches of 64, 2 worker processes or
2 threads. `python bench/peer_loaders.py NAME` prints one JSON line: NAME's images/s in epoch 2 of 2.

Run by the peers' own venv (.venv-peers: DALI, FFCV, litdata and mosaicml-streaming bring numpy, numba and CUDA
wheels of their own; torch and torchvision at the lock's pins), the stock torchvision row too, so this file imports
only torch and torchvision at the top and each peer inside its builder. Each peer's converted copy of the photos
(.beton, MDS, litdata chunks) is written once into the cache folder, outside the timing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torchvision.datasets import ImageFolder
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

SIZE, BATCH, WORKERS, EPOCHS = 224, 64, 2, 2
Epoch = Callable[[], Iterable[torch.Tensor]]  # one epoch's uint8 image batches


def epoch_rate(batches: Iterable) -> float:
    """Images/s over a whole epoch, first batch included, as the training loop's epoch figure (images_per_s in
    metrics.jsonl) counts it, so every row of the table is read off the same clock."""
    start, images = time.perf_counter(), 0
    for batch in batches:
        images += batch.shape[0]
    return images / (time.perf_counter() - start)


def augment() -> v2.Compose:
    """The recipe in torchvision v2 on a decoded uint8 tensor: what the rows with torchvision decode apply."""
    return v2.Compose([v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip()])


AUGMENT = augment()


def decode_augment(sample: dict) -> tuple[torch.Tensor, int]:
    """A stored sample's JPEG bytes decoded by torchvision (libjpeg-turbo), then the recipe: the rows that store
    the files' bytes (litdata, MDS) share it. At module level, so a spawned worker can unpickle it."""
    raw = torch.frombuffer(bytearray(sample["image"]), dtype=torch.uint8)
    return AUGMENT(decode_jpeg(raw, mode=ImageReadMode.RGB)), sample["label"]


def images_of(batches: Iterable, key: Callable) -> Epoch:
    return lambda: (key(batch) for batch in batches)


def torchvision_loader(photos: Path, cache: Path) -> Epoch:
    """ImageFolder + v2 + DataLoader as torchvision's docs combine them (the default PIL loader, v2.ToImage first)."""
    from torch.utils.data import DataLoader

    dataset = ImageFolder(str(photos / "train"), transform=v2.Compose([v2.ToImage(), augment()]))
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, drop_last=True, num_workers=WORKERS,
                        persistent_workers=True)
    return images_of(loader, lambda batch: batch[0])


def litdata_loader(photos: Path, cache: Path) -> Epoch:
    """litdata: `optimize` writes the JPEG files' bytes into chunks once; a StreamingDataset decodes them with
    torchvision through its `transform` and a StreamingDataLoader (spawned workers) batches them."""
    import litdata

    out = cache / "litdata"
    if not (out / "index.json").exists():
        samples = ImageFolder(str(photos / "train")).samples
        litdata.optimize(fn=_litdata_sample, inputs=samples, output_dir=str(out), num_workers=WORKERS,
                         chunk_bytes="64MB", mode="overwrite")
    dataset = litdata.StreamingDataset(str(out), shuffle=True, drop_last=True, transform=decode_augment)
    loader = litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True,
                                         drop_last=True)
    return images_of(loader, lambda batch: batch[0])


def _litdata_sample(sample: tuple[str, int]) -> dict:
    path, label = sample
    return {"image": Path(path).read_bytes(), "label": label}


def mosaic_loader(photos: Path, cache: Path) -> Epoch:
    """mosaicml-streaming: an MDSWriter writes the JPEG bytes into MDS shards once; a StreamingDataset subclass
    decodes them with torchvision in __getitem__ (its docs' way to transform), batched by a DataLoader."""
    from streaming import MDSWriter, StreamingDataset
    from torch.utils.data import DataLoader

    out = cache / "mds"
    if not (out / "index.json").exists():
        with MDSWriter(out=str(out), columns={"image": "bytes", "label": "int"}, size_limit="64mb") as writer:
            for path, label in ImageFolder(str(photos / "train")).samples:
                writer.write({"image": Path(path).read_bytes(), "label": label})

    class Photos(StreamingDataset):
        def __getitem__(self, index):
            return decode_augment(super().__getitem__(index))

    dataset = Photos(local=str(out), shuffle=True, batch_size=BATCH)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True, drop_last=True)
    return images_of(loader, lambda batch: batch[0])


def ffcv_loader(photos: Path, cache: Path) -> Epoch:
    """FFCV: its DatasetWriter writes a .beton once (JPEGs at quality 90, full size, as the photos are); its Loader
    decodes with RandomResizedCropRGBImageDecoder (crop, then resize, in its own JPEG decode) on 2 threads."""
    from ffcv.fields import IntField, RGBImageField
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage
    from ffcv.writer import DatasetWriter

    beton = cache / "ffcv" / "train.beton"
    if not beton.exists():
        beton.parent.mkdir(parents=True, exist_ok=True)
        writer = DatasetWriter(str(beton.with_suffix(".part")), {
            "image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()}, num_workers=WORKERS)
        writer.from_indexed_dataset(ImageFolder(str(photos / "train")))
        beton.with_suffix(".part").rename(beton)
    loader = Loader(str(beton), batch_size=BATCH, num_workers=WORKERS, order=OrderOption.RANDOM, drop_last=True,
                    os_cache=True, pipelines={
                        "image": [RandomResizedCropRGBImageDecoder((SIZE, SIZE)), RandomHorizontalFlip(), ToTensor(),
                                  ToTorchImage()],
                        "label": [IntDecoder(), ToTensor()]})
    return images_of(loader, lambda batch: batch[0])


def dali_loader(photos: Path, cache: Path) -> Epoch:
    """NVIDIA DALI on the CPU alone (device_id=None): a file reader, decoders.image_random_crop (libjpeg-turbo
    decodes only the crop's region), resize, and crop_mirror_normalize for the flip and the CHW uint8 layout, on
    2 threads, through its PyTorch iterator."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def(batch_size=BATCH, num_threads=WORKERS, device_id=None)
    def photos_pipeline():
        jpegs, labels = fn.readers.file(file_root=str(photos / "train"), random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
        images = fn.resize(images, resize_x=SIZE, resize_y=SIZE)
        images = fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW",
                                          mirror=fn.random.coin_flip())
        return images, labels

    pipe = photos_pipeline()
    pipe.build()
    loader = DALIGenericIterator(pipe, ["images", "labels"], reader_name="reader", auto_reset=True,
                                 last_batch_policy=LastBatchPolicy.DROP)
    return images_of(loader, lambda batch: batch[0]["images"])


# name -> (builder, the distribution whose version the table names)
PEERS = {"torchvision": (torchvision_loader, "torchvision"), "litdata": (litdata_loader, "litdata"),
         "ffcv": (ffcv_loader, "ffcv"), "mosaic": (mosaic_loader, "mosaicml-streaming"),
         "dali": (dali_loader, "nvidia-dali-cuda130")}


def second_epoch_rate(epoch: Epoch) -> float:
    """Epoch 1 untimed (workers started, JIT compiled, page cache warm), then epoch 2 of 2 timed."""
    for _ in range(EPOCHS - 1):
        for _batch in epoch():
            pass
    return epoch_rate(epoch())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer", choices=PEERS)
    parser.add_argument("--photos", type=Path, required=True, help="the ImageFolder of photos (train/<class>/)")
    parser.add_argument("--cache", type=Path, required=True, help="where each peer's converted copy is kept")
    parser.add_argument("--prepare", action="store_true", help="only write the converted copy (untimed)")
    args = parser.parse_args()
    build, distribution = PEERS[args.peer]
    epoch = build(args.photos, args.cache)
    figure = {} if args.prepare else {"images_per_s": second_epoch_rate(epoch)}
    print(json.dumps({"version": importlib.metadata.version(distribution), **figure}), flush=True)


if __name__ == "__main__":
    main()
