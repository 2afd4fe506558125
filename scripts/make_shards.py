#!/usr/bin/env python3
"""Write a dataset as WebDataset tar shards with an _info.json: what `dataset=shards` reads, from a folder, a web
server or an S3-compatible store.

    python scripts/make_shards.py data/synthetic data/shards                  # an ImageFolder (train/ and val/)
    python scripts/make_shards.py data/photos data/shards --max-side 512      # re-encode large photos smaller
    python scripts/make_shards.py data/synthetic-voc data/voc-shards          # a VOC folder: task=segmentation
    aws s3 sync data/shards s3://bucket/shards       # then train: dataset=shards data.root=s3://bucket/shards

Each sample is `<key>.jpg` (or the file's own format) and `<key>.cls`, in an order shuffled by --seed; shards are
`<split>/shard-NNNNNN.tar` of about --shard-bytes each; _info.json lists each shard's sample count and distinct
labels (`labels_per_shard`: the training order's window is sized by how mixed they are). A Pascal VOC-layout folder
(ImageSets/Segmentation/, dataset=voc) gives `<key>.jpg` and its mask `<key>.png`, both as stored, and _info.json
says `"masks": true` and carries the folder's classes. The output is
deterministic: the same input gives the same bytes (fixed tar headers), so a re-run does not re-upload. Sources: an
ImageFolder (root/train, root/val), or any loadout source class (`--source pkg.Class` built with `split=`, that
offers `read_encoded` or images).
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from pathlib import Path

import numpy as np
from hydra.utils import get_object
from PIL import Image
from tqdm import tqdm

from loadout.data.datasets import ImageFolderDataset
from loadout.data.fast.decode import JPEG_MAGIC
from loadout.data.source import as_uint8_tensor
from loadout.data.voc import VOCSegmentation


def encoded(source, index: int, max_side: int | None) -> tuple[bytes, str, int]:
    """The sample's file as stored (re-encoded as a JPEG of at most `max_side` px when it is larger), its
    extension, and its label."""
    if hasattr(source, "read_encoded"):
        data, label = source.read_encoded(index)
        if max_side is None:
            return data, "jpg" if data[:3] == JPEG_MAGIC else _format(data), int(label)
        image = Image.open(io.BytesIO(data)).convert("RGB")
    else:
        pixels, label = source[index][:2]
        image = Image.fromarray(as_uint8_tensor(pixels).permute(1, 2, 0).contiguous().numpy())
    if max_side and max(image.size) > max_side:
        image.thumbnail((max_side, max_side), Image.BICUBIC)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90)
    return out.getvalue(), "jpg", int(label)


def _format(data: bytes) -> str:
    with Image.open(io.BytesIO(data)) as image:
        return (image.format or "png").lower()


def members(source, index: int, max_side: int | None) -> tuple[list[tuple[str, bytes]], int | None]:
    """The sample's (extension, bytes) members and its label (None for a segmentation pair)."""
    if hasattr(source, "read_files"):  # an image and its mask (voc.py): stored as they are
        image, mask = source.read_files(index)
        return [("jpg", image), ("png", mask)], None
    data, ext, label = encoded(source, index, max_side)
    return [(ext, data), ("cls", str(label).encode())], label


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o444, "loadout", "loadout"
    tar.addfile(info, io.BytesIO(data))


def write_split(source, out: Path, split: str, shard_bytes: int, max_side: int | None,
                seed: int) -> tuple[list[str], list[int], list[int]]:
    """The split's shards, its samples in an order shuffled by `seed` (folders list a class at a time, and training
    reads a window of shards at a time); returns their names (relative to `out`), sample counts and distinct
    labels."""
    (out / split).mkdir(parents=True, exist_ok=True)
    order = np.random.default_rng(seed).permutation(len(source)).tolist()
    names, lengths, distinct, position = [], [], [], 0
    with tqdm(total=len(order), desc=split, unit="img") as bar:
        while position < len(order):
            names.append(f"{split}/shard-{len(names):06d}.tar")
            start, size, labels = position, 0, set()
            with tarfile.open(out / names[-1], "w", format=tarfile.USTAR_FORMAT) as tar:
                while position < len(order) and size < shard_bytes:
                    index = order[position]
                    parts, label = members(source, index, max_side)
                    for ext, data in parts:
                        add(tar, f"{index:09d}.{ext}", data)
                    labels.add(label)
                    size, position = size + sum(len(data) for ext, data in parts if ext != "cls") + 2048, position + 1
            lengths.append(position - start)
            distinct.append(len(labels))
            bar.update(position - start)
    return names, lengths, distinct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="ImageFolder root with train/ and val/ (or what --source reads)")
    parser.add_argument("out", type=Path, help="output folder: gets train/, val/ and _info.json")
    parser.add_argument("--shard-bytes", type=int, default=256 << 20, help="target shard size (default 256 MiB)")
    parser.add_argument("--max-side", type=int, help="re-encode images larger than this (px) as JPEG at this size")
    parser.add_argument("--seed", type=int, default=0, help="the shuffled order's seed (the same seed, the same bytes)")
    parser.add_argument("--source", help="a source class of your own (pkg.Class(root, split=...)) instead of "
                        "ImageFolder")
    args = parser.parse_args()
    voc = not args.source and (Path(args.src) / "ImageSets" / "Segmentation").is_dir()
    if voc and args.max_side:
        parser.error("--max-side: a VOC folder's images and masks are written as stored (resize them together first)")
    make = get_object(args.source) if args.source else VOCSegmentation if voc else ImageFolderDataset
    info = {"splits": {}, **({"masks": True} if voc else {})}
    for split in ("train", "val"):
        source = make(args.src, split=split)
        names, lengths, distinct = write_split(source, args.out, split, args.shard_bytes, args.max_side, args.seed)
        info["classes"] = list(source.classes)
        info["splits"][split] = {"filenames": names, "shard_lengths": lengths, "num_samples": sum(lengths),
                                  **({} if voc else {"labels_per_shard": distinct})}
        print(f"{args.out / split}: {sum(lengths)} samples in {len(names)} shards")
    (args.out / "_info.json").write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    main()
