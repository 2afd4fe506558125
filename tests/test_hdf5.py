"""dataset=hdf5 reads HDF5 files as other tools write them (h5py directly: vlen uint8 encoded files, chunked and
compressed pixels in either channel order, a group per split or a file per split, class names as a dataset or an
attribute) and as scripts/convert_dataset.py writes them, through real DataLoader workers, each of which opens the
file itself; masks work with task=segmentation; a bad sample is skipped; a file or key that does not fit is one line."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from loadout.data.datasets import ImageFolderDataset
from loadout.data.fast.decode import decode_image_file
from loadout.data.files.hdf5_source import HDF5Encoded, HDF5Pixels, hdf5_source
from loadout.data.samples import Samples
from loadout.data.voc import VOCSegmentation
from loadout.dist import DistEnv
from loadout.errors import ConfigError
from tests.conftest import compose_config, read_metrics, run_cli
from tests.test_segmentation_data import write_voc
from tests.test_segmentation_stores import aligned_batches, check_aligned
from train.job import data_from_config

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
VLEN = h5py.vlen_dtype(np.dtype("uint8"))


def write_encoded(path: Path, folder: Path, classes_as: str = "attribute") -> None:
    """The ImageFolder's files as h5py's docs write vlen data: a group per split, `images` + `labels`."""
    with h5py.File(path, "w") as f:
        for split in ("train", "val"):
            source = ImageFolderDataset(folder, split)
            group = f.create_group(split)
            images = group.create_dataset("images", (len(source),), dtype=VLEN)
            for i in range(len(source)):
                images[i] = np.frombuffer(source.read_encoded(i)[0], dtype=np.uint8)
            group.create_dataset("labels", data=source.targets.astype(np.int32))
        if classes_as == "attribute":
            f.attrs["classes"] = source.classes
        else:
            f.create_dataset("classes", data=source.classes, dtype=h5py.string_dtype())


def pixels_of(folder: Path, split: str, size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    source = ImageFolderDataset(folder, split)
    images = np.stack([np.array(Image.open(p.decode()).convert("RGB").resize((size, size))) for p in source.paths])
    return images, source.targets


def first_batches(overrides: list[str], root: Path, workers: int = 2) -> list:
    cfg = compose_config(["hardware=cpu", f"data.root={root}", "data.image_size=24", "data.batch_size=8",
                          f"data.num_workers={workers}", "trainer.epochs=1", *overrides])
    with data_from_config(cfg, DistEnv(), CPU) as data:
        return list(data.train.loader)


def test_encoded_files_read_as_the_folder_decodes_them_in_workers(tiny_dataset, tmp_path):
    write_encoded(tmp_path / "set.h5", tiny_dataset)
    folder = ImageFolderDataset(tiny_dataset, "val")
    source = hdf5_source(tmp_path / "set.h5", "val")
    assert isinstance(source, HDF5Encoded) and source.classes == folder.classes
    assert source.layout.image_spans is not None  # h5py's default layout: rows sliced from the mapped file
    assert np.array_equal(source.targets, folder.targets) and isinstance(source.targets, np.ndarray)
    assert source.read_encoded(5) == folder.read_encoded(5)
    loader = DataLoader(source, batch_size=16, num_workers=2, collate_fn=list)
    read = [sample for batch in loader for sample in batch]
    for index in (0, 17, len(folder) - 1):
        assert torch.equal(read[index][0], folder[index][0]) and read[index][1] == folder[index][1]
    batches = first_batches(["dataset=hdf5"], tmp_path / "set.h5")
    assert sum(len(b) for b in batches) == len(ImageFolderDataset(tiny_dataset, "train"))


def test_pixels_in_either_channel_order_compressed_in_a_file_per_split(tiny_dataset, tmp_path):
    (tmp_path / "set").mkdir()
    for split, compression, order in (("train", "gzip", "last"), ("val", "lzf", "first")):
        images, labels = pixels_of(tiny_dataset, split)
        stored = images if order == "last" else images.transpose(0, 3, 1, 2)
        with h5py.File(tmp_path / "set" / f"{split}.h5", "w") as f:
            f.create_dataset("x", data=stored, chunks=(1, *stored.shape[1:]), compression=compression)
            f.create_dataset("y", data=labels)
            f.create_dataset("classes", data=ImageFolderDataset(tiny_dataset, split).classes)
        source = hdf5_source(tmp_path / "set", split, images="x", labels="y")
        assert isinstance(source, HDF5Pixels) and source.size == 32 and source.decoded
        assert torch.equal(source[3][0], torch.from_numpy(images[3]).permute(2, 0, 1)) and source[3][1] == labels[3]
        crops = source.read_crops([4, 2, 4], [0, 5, 8], [1, 0, 8], 24, 24, [False, True, False])
        assert torch.equal(crops[1], torch.from_numpy(images[2][5:29, 0:24]).permute(2, 0, 1).flip(-1))
        assert torch.equal(crops[2], torch.from_numpy(images[4][8:32, 8:32]).permute(2, 0, 1))
    # data.resize_size=32: the stored side, so the batch crop reads whole batches (packed's path), in workers
    batches = first_batches(["dataset=hdf5", "dataset.images=x", "dataset.labels=y", "data.resize_size=32"],
                            tmp_path / "set")
    assert sum(len(b) for b in batches) == len(ImageFolderDataset(tiny_dataset, "train"))


def test_each_worker_opens_the_file_itself_and_the_main_process_handle_never_crosses_the_fork(tiny_dataset,
                                                                                                 tmp_path):
    write_encoded(tmp_path / "set.h5", tiny_dataset)
    source = hdf5_source(tmp_path / "set.h5", "val")
    source[0]  # the main process reads (as the first-sample check does): its file is open
    opened = source.rows.get().file
    assert opened.id.valid

    def owner(batch):
        import os
        return os.getpid(), source.rows._pid == os.getpid(), source.rows.get().file.id.valid

    loader = DataLoader(source, batch_size=8, num_workers=2, collate_fn=owner)
    seen = set(loader)
    assert not opened.id.valid  # closed in the main process just before the workers forked
    assert {own for _, own, _ in seen} == {True} and {valid for _, _, valid in seen} == {True}
    assert len({pid for pid, _, _ in seen}) == 2
    assert torch.equal(source[1][0], decode_image_file(ImageFolderDataset(tiny_dataset, "val").read_encoded(1)[0]))


def test_a_truncated_image_is_skipped_and_named(tiny_dataset, tmp_path, caplog):
    write_encoded(tmp_path / "set.h5", tiny_dataset)
    with h5py.File(tmp_path / "set.h5", "r+") as f:
        f["train/images"][2] = f["train/images"][2][:60]
    source = hdf5_source(tmp_path / "set.h5", "train")
    samples = Samples(source, lambda image: image, seed=0)
    with caplog.at_level(logging.WARNING):
        assert samples[2] is None and samples[3] is not None
    assert "set.h5:/train/images[2] (sample 2)" in caplog.text


def test_masks_as_pixels_and_as_pngs_train_segmentation(tmp_path):
    voc = write_voc(tmp_path / "voc", count=24)
    (voc / "classes.txt").write_text("background\nred\ngreen\nblue\n")
    run = subprocess.run([sys.executable, "scripts/convert_dataset.py", str(voc), str(tmp_path / "png.h5"), "--to",
                          "hdf5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    source = hdf5_source(tmp_path / "png.h5", "train")
    assert source.classes == ["background", "red", "green", "blue"] and not hasattr(source, "targets")
    check_aligned(*aligned_batches(source))
    voc_source = VOCSegmentation(voc, "train")
    with h5py.File(tmp_path / "raw.h5", "w") as f:  # raw masks beside encoded images, written by hand
        f.create_dataset("train/images", data=[np.frombuffer(voc_source.read_files(i)[0], np.uint8)
                                               for i in range(len(voc_source))], dtype=VLEN)
        f.create_dataset("train/masks", data=np.stack([voc_source[i][1].numpy() for i in range(len(voc_source))]),
                         chunks=True, compression="gzip")
    raw = hdf5_source(tmp_path / "raw.h5", "train", class_names=4)
    assert raw.classes == ["0", "1", "2", "3"] and torch.equal(raw[5][1], voc_source[5][1])
    check_aligned(*aligned_batches(raw))


def test_the_converter_writes_what_the_folder_holds(tiny_dataset, tmp_path):
    for name, extra in (("encoded.h5", []), ("pixels.h5", ["--pixels", "36", "--compression", "gzip"]),
                        ("mapped.h5", ["--pixels", "36"])):
        run = subprocess.run([sys.executable, "scripts/convert_dataset.py", str(tiny_dataset),
                              str(tmp_path / name), "--to", "hdf5", *extra], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
    folder = ImageFolderDataset(tiny_dataset, "train")
    encoded, pixels = hdf5_source(tmp_path / "encoded.h5", "train"), hdf5_source(tmp_path / "pixels.h5", "train")
    assert encoded.read_encoded(7) == folder.read_encoded(7)
    assert pixels.size == 36 and pixels[7][0].shape == (3, 36, 36) and pixels[7][1] == folder.targets[7]
    assert encoded.classes == pixels.classes == folder.classes
    mapped = hdf5_source(tmp_path / "mapped.h5", "train")  # uncompressed: rows read from the mapped file
    assert pixels.layout.pixel_offsets is None and mapped.layout.pixel_offsets is not None
    assert all(torch.equal(mapped[i][0], pixels[i][0]) for i in (0, 7, len(folder) - 1))
    crops = [s.read_crops([9, 2], [1, 3], [2, 0], 32, 32, [True, False]) for s in (mapped, pixels)]
    assert torch.equal(*crops)
    assert torch.equal(crops[0][0], mapped[9][0][:, 1:33, 2:34].flip(-1))  # the mirrored box, as a view would give
    assert torch.equal(crops[0][1], mapped[2][0][:, 3:35, 0:32])
    mirrored = [s.read_crops([9, 2, 9], [1, 3, 0], [2, 0, 4], 32, 32, [True] * 3) for s in (mapped, pixels)]
    assert torch.equal(*mirrored) and torch.equal(mirrored[0][2], mapped[9][0][:, 0:32, 4:36].flip(-1))
    with h5py.File(tmp_path / "pixels.h5", "r", locking=False) as f:  # as the source holds it open
        assert f["train/images"].compression == "gzip" and f["train/images"].chunks == (1, 36, 36, 3)


def test_files_and_keys_that_do_not_fit_are_one_line(tiny_dataset, tmp_path):
    write_encoded(tmp_path / "set.h5", tiny_dataset, classes_as="dataset")
    cases = [
        (dict(root=tmp_path / "nothing.h5"), "does not exist"),
        (dict(root=tmp_path), "no HDF5 file for the train split (looked for train.h5"),
        (dict(root=tmp_path / "set.h5", split_keys={"train": "training"}), "no group `training`"),
        (dict(root=tmp_path / "set.h5", images="x"), "has no `x` in train"),
        (dict(root=tmp_path / "set.h5", labels="y"), "it has images (240,) object, labels (240,) int32"),
    ]
    (tmp_path / "text.h5").write_text("not HDF5")
    cases.append((dict(root=tmp_path / "text.h5"), "cannot read"))
    with h5py.File(tmp_path / "odd.h5", "w") as f:
        f.create_dataset("train/images", data=np.zeros((4, 3, 8, 3), np.uint8))
        f.create_dataset("train/labels", data=np.zeros(4, np.int64))
    cases.append((dict(root=tmp_path / "odd.h5"), "set dataset.channels to last"))
    for kwargs, said in cases:
        with pytest.raises(ConfigError, match="^(data.root|dataset)") as err:
            hdf5_source(**kwargs)
        assert said in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_mix_and_sample_cache_take_an_hdf5_source(tiny_dataset, tmp_path):
    write_encoded(tmp_path / "set.h5", tiny_dataset)
    cached = first_batches(["dataset=hdf5", "data.cache_bytes=8000000"], tmp_path / "set.h5")
    mixed = first_batches(["dataset=mix", "dataset.sources.main._target_=loadout.data.files.hdf5_source.hdf5_source",
                           f"dataset.sources.main.root={tmp_path / 'set.h5'}"], tiny_dataset)
    assert sum(len(b) for b in cached) == sum(len(b) for b in mixed) == 240


@pytest.mark.slow
def test_python_m_train_trains_an_epoch_and_counts_a_truncated_image(tiny_dataset, tmp_path):
    write_encoded(tmp_path / "set.h5", tiny_dataset)
    with h5py.File(tmp_path / "set.h5", "r+") as f:
        f["train/images"][9] = f["train/images"][9][:50]
    run = run_cli(["hardware=cpu", "dataset=hdf5", f"data.root={tmp_path / 'set.h5'}", "data.image_size=32",
                   "data.batch_size=16", "data.num_workers=2", "trainer.epochs=1", "trainer.progress=false",
                   f"hydra.run.dir={tmp_path / 'run'}"])
    assert run.returncode == 0, run.stderr[-3000:]
    epoch = read_metrics(tmp_path / "run")[-1]
    assert epoch["bad_samples"] == 1 and epoch["images"] + epoch["bad_samples"] == 240 and epoch["val_samples"] == 80


def test_png_and_webp_bytes_decode_to_their_pixels(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    files = [encode(images[0], "PNG"), encode(images[1], "WEBP", lossless=True)]
    with h5py.File(tmp_path / "set.h5", "w") as f:  # chunked, compressed: no mapping, HDF5 reads the rows
        f.create_dataset("train/images", data=[np.frombuffer(b, np.uint8) for b in files], dtype=VLEN, chunks=(1,),
                         compression="gzip")
        f.create_dataset("train/labels", data=[0, 1])
    source = hdf5_source(tmp_path / "set.h5", "train")
    assert source.classes == ["0", "1"] and source.layout.image_spans is None
    assert source.read_encoded(1) == (files[1], 1)
    for index in (0, 1):
        assert torch.equal(source[index][0], torch.from_numpy(images[index]).permute(2, 0, 1))


def encode(image: np.ndarray, format: str, **options) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format, **options)
    return out.getvalue()
