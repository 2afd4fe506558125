#!/usr/bin/env python3
"""Write an ImageFolder (root/train, root/val) or a Pascal VOC-layout folder as HDF5 or LMDB, the formats many
datasets already come in (dataset=hdf5, dataset=lmdb; docs/data.md has their layouts).

    python scripts/convert_dataset.py data/synthetic data/synthetic.h5 --to hdf5     # encoded files as they are
    python scripts/convert_dataset.py data/synthetic data/pixels.h5 --to hdf5 --pixels 73 --compression lzf
    python scripts/convert_dataset.py data/synthetic-voc data/voc.h5 --to hdf5       # images + PNG masks
    python scripts/convert_dataset.py data/synthetic data/synthetic-lmdb --to lmdb   # OUT/train, OUT/val

HDF5: one file, a group per split: `images` (variable-length uint8: each file's bytes unchanged; with --pixels, uint8
N x S x S x 3 squares at S px, chunked one image a chunk), `labels` or `masks` (PNG bytes; with --pixels, N x S x S),
`classes`. LMDB: one environment per split: each image's bytes under its relative path, with `__keys__`,
`__labels__` and `__classes__` (msgpack lists). Both written as h5py's and lmdb's own documentation write them. The way
out for an LMDB of pickled values: unpickle it once (with the code that wrote it) into an ImageFolder, then this.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadout.data.datasets import ImageFolderDataset  # noqa: E402
from loadout.data.voc import VOCSegmentation  # noqa: E402
from scripts.pack_dataset import Fitted  # noqa: E402

BLOCK = 256  # samples written at a time


def open_split(src: Path, split: str):
    """The split of a VOC-layout folder or an ImageFolder."""
    if (src / "ImageSets" / "Segmentation").is_dir():
        return VOCSegmentation(src, split)
    return ImageFolderDataset(src, split)


def files_of(dataset, index: int) -> tuple[bytes, bytes | int]:
    """(the image file's bytes, its label or its mask's PNG bytes), as stored."""
    return dataset.read_files(index) if isinstance(dataset, VOCSegmentation) else dataset.read_encoded(index)


def write_hdf5_split(f, split: str, dataset, pixels: int | None, compression: str | None, workers: int) -> int:
    """The split as a group of `f`: encoded files, or `pixels`-px squares; returns the samples written."""
    import h5py

    group, masks, n = f.create_group(split), isinstance(dataset, VOCSegmentation), len(dataset)
    group.create_dataset("classes", data=list(dataset.classes), dtype=h5py.string_dtype())
    target_key = "masks" if masks else "labels"
    if pixels is None:
        vlen = h5py.vlen_dtype(np.dtype("uint8"))
        images = group.create_dataset("images", (n,), dtype=vlen)
        targets = group.create_dataset(target_key, (n,), dtype=vlen) if masks else \
            group.create_dataset(target_key, (n,), dtype=np.int64)
        for start in range(0, n, BLOCK):
            block = [files_of(dataset, i) for i in range(start, min(n, start + BLOCK))]
            images[start:start + len(block)] = _vlen([image for image, _ in block])
            targets[start:start + len(block)] = _vlen([t for _, t in block]) if masks else [t for _, t in block]
        return n
    images = group.create_dataset("images", (n, pixels, pixels, 3), maxshape=(None, pixels, pixels, 3),
                                  dtype=np.uint8, chunks=(1, pixels, pixels, 3), compression=compression)
    shape = (pixels, pixels) if masks else ()
    targets = group.create_dataset(target_key, (n, *shape), maxshape=(None, *shape),
                                   dtype=np.uint8 if masks else np.int64, chunks=(1, *shape) if masks else (BLOCK,),
                                   compression=compression if masks else None)
    written = 0
    for batch_images, batch_targets, keep in DataLoader(Fitted(dataset, pixels), batch_size=64,
                                                        num_workers=workers):
        count = int(keep.sum())
        images[written:written + count] = batch_images[keep].permute(0, 2, 3, 1).numpy()
        targets[written:written + count] = batch_targets[keep].numpy()
        written += count
    if written < n:  # unreadable samples were left out
        images.resize(written, axis=0)
        targets.resize(written, axis=0)
    return written


def _vlen(files: list[bytes]) -> np.ndarray:
    column = np.empty(len(files), dtype=object)
    column[:] = [np.frombuffer(data, dtype=np.uint8) for data in files]
    return column


def write_lmdb_split(path: Path, dataset) -> int:
    """The split as one environment at `path`: each image's bytes under its relative path, and the key list,
    labels and class names (msgpack); returns the samples written."""
    import lmdb
    import msgpack

    if isinstance(dataset, VOCSegmentation):
        raise SystemExit("convert_dataset: LMDB holds images with labels; write a VOC folder's masks with --to hdf5")
    root = Path(dataset.paths[0].decode()).parents[1]
    # a value over half a page takes whole overflow pages, the B-tree pages come on top: room for twice that
    total = sum(Path(p.decode()).stat().st_size + 8192 for p in dataset.paths)
    env = lmdb.open(str(path), map_size=2 * total + (64 << 20))
    keys = []
    txn = env.begin(write=True)
    for index in range(len(dataset)):
        data, _ = dataset.read_encoded(index)
        key = str(Path(dataset.paths[index].decode()).relative_to(root)).encode()
        txn.put(key, data)
        keys.append(key)
        if index % 1000 == 999:  # commit in steps: one huge transaction holds every dirty page
            txn.commit()
            txn = env.begin(write=True)
    txn.put(b"__keys__", msgpack.packb(keys, use_bin_type=True))
    txn.put(b"__labels__", msgpack.packb(dataset.targets.tolist()))
    txn.put(b"__classes__", msgpack.packb(list(dataset.classes)))
    txn.commit()
    env.close()
    return len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="an ImageFolder root with train/ and val/, or a VOC-layout folder")
    parser.add_argument("out", type=Path, help="hdf5: the file to write; lmdb: a folder (gets train/ and val/)")
    parser.add_argument("--to", choices=("hdf5", "lmdb"), required=True)
    parser.add_argument("--pixels", type=int, default=None,
                        help="hdf5: store uint8 squares of this side (the training resize size) instead of the files")
    parser.add_argument("--compression", choices=("gzip", "lzf", "none"), default="none",
                        help="hdf5 --pixels: the chunks' compression (default none: the fastest to read)")
    parser.add_argument("--workers", type=int, default=2, help="hdf5 --pixels: decoding processes")
    args = parser.parse_args()
    if args.to == "hdf5":
        import h5py

        args.out.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(args.out, "w") as f:
            for split in ("train", "val"):
                dataset = open_split(args.src, split)
                written = write_hdf5_split(f, split, dataset, args.pixels,
                                           None if args.compression == "none" else args.compression, args.workers)
                print(f"{args.out}:/{split}: {written} of {len(dataset)} samples")
        return
    for split in ("train", "val"):
        dataset = open_split(args.src, split)
        (args.out / split).mkdir(parents=True, exist_ok=True)
        written = write_lmdb_split(args.out / split, dataset)
        print(f"{args.out / split}: {written} samples")


if __name__ == "__main__":
    main()
