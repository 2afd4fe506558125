"""data.decode=device on a CPU (trainer.device=cpu runs the same code as CUDA, with torchcodec's CPU decoder): workers
ship encoded files through the shared-memory ring, the batch is decoded where it trains, the boxes are those of a
CPU-decoded run of the same seed, refused files fall back to the CPU (counted), bad ones are skipped, resume is
exact; device memory, /dev/shm and a device that cannot decode stay bounded and said."""

from __future__ import annotations

import io
import itertools
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from loadout.data.fast.decode import exif_orientation
from loadout.data.fast.encoded import (
    FLIP,
    SLOT_CAP_BYTES,
    DeviceDecoder,
    Encoded,
    EncodedSample,
    as_stored,
    place,
    resize_group,
    slot_bytes,
)
from loadout.data.geometry import BoxPlan
from loadout.data.transforms import MEAN, STD
from loadout.dist import DistEnv
from loadout.errors import ConfigError
from scripts.make_dataset import make_synthetic_imagefolder
from tests.conftest import ROOT, compose_config, read_metrics, run_cli, whole_and_resumed
from train.config import validate
from train.job import data_from_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def config(root: Path, *extra: str):
    return compose_config(["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16",
                           "trainer.epochs=2", *extra])


def epoch(cfg, epoch_index: int = 0, limit: int | None = None, device: torch.device = CPU) \
        -> tuple[list, list, object]:
    """(training batches, validation images, the training collate) of one epoch, run on `device`, copied to the
    CPU."""
    with data_from_config(cfg, DistEnv(), device) as data:
        data.set_epoch(epoch_index)
        train = [(b.images.to(CPU, copy=True), b.targets.to(CPU, copy=True), b.bad, b.decode_fallbacks)
                 for b in itertools.islice(data.train, limit)]
        val = [b.images.to(CPU, copy=True) for b in data.val]
        return train, val, data.train.loader.collate_fn.collate


def tag_orientation(path: Path, orientation: int) -> None:
    """Re-save a JPEG with an EXIF orientation tag, as a camera writes one (the pixels stay as stored)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    with Image.open(path) as image:
        image.load()
    image.save(path, quality=92, exif=exif.tobytes())


def pixels(images: torch.Tensor) -> torch.Tensor:
    """Normalized device images back to 0-255."""
    return images * torch.tensor(STD).view(1, 3, 1, 1) * 255 + torch.tensor(MEAN).view(1, 3, 1, 1) * 255


@pytest.mark.parametrize("recipe", ["crop_flip", "imagenet"])
def test_device_decode_gives_the_pixels_of_a_cpu_decoded_run_through_the_ring(tiny_dataset, recipe):
    """No DCT scaling at these sizes, and torchcodec's CPU decoder is libjpeg-turbo too: the same boxes give the
    same pixels, bit for bit, training and validation, whatever the workers."""
    cpu, cpu_val, _ = epoch(config(tiny_dataset, f"augment={recipe}", "data.num_workers=0"))
    device, device_val, ring = epoch(config(tiny_dataset, f"augment={recipe}", "data.num_workers=2",
                                            "data.decode=device"))
    assert len(cpu) == len(device) == 15
    for (a, labels_a, _, _), (b, labels_b, _, fallbacks) in zip(cpu, device, strict=True):
        assert torch.equal(a, b) and torch.equal(labels_a, labels_b) and fallbacks == 0
    assert all(torch.equal(a, b) for a, b in zip(cpu_val, device_val, strict=True))
    assert ring.buffers.dtype == torch.uint8 and ring.buffers.dim() == 3  # encoded files, not images, in the slots
    assert int(ring.overruns) == 0 and int(ring.received.max()) > 0, "every batch went through the ring"


@pytest.mark.slow
def test_dct_scaled_photos_crop_the_same_boxes(tmp_path):
    """640 x 480 photos at a 37 px resize, half of them tagged "rotate 90" or "rotate 270": the CPU path decodes at
    1/8 as stored and crops there; the device decodes whole, upright, turns it back and resizes to the same size
    first, so the boxes match and the pixels nearly."""
    root = make_synthetic_imagefolder(tmp_path / "photos", train_per_class=2, val_per_class=1, photo=(640, 480))
    for n, path in enumerate(sorted(root.glob("train/*/*.jpg"))[::2]):
        tag_orientation(path, 6 if n % 2 else 8)
    common = ("data.num_workers=0", "data.batch_size=4")
    for recipe in ("crop_flip", "imagenet"):
        cpu, _, _ = epoch(config(root, f"augment={recipe}", *common), limit=3)
        device, _, _ = epoch(config(root, f"augment={recipe}", "data.decode=device", *common), limit=3)
        for (a, _, _, _), (b, _, _, _) in zip(cpu, device, strict=True):
            error = (pixels(a) - pixels(b)).abs()
            assert float(error.mean()) < 6, recipe  # another crop would differ by tens of levels
            mse = float((error**2).mean())
            assert 10 * np.log10(255**2 / mse) >= 26, recipe


def test_a_batch_is_placed_as_each_image_alone():
    """place() resizes images of one size together, crops of one size together and flips together: every image
    comes out as it does placed alone, bit for bit, whatever the sizes, layouts, boxes and recipes beside it."""
    generator = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, *size), dtype=torch.uint8, generator=generator)
              for size in [(75, 100), (75, 100), (100, 75), (75, 100), (80, 80), (100, 75), (75, 100), (80, 80)] * 2]
    images[3] = images[3].permute(1, 2, 0).contiguous().permute(2, 0, 1)  # HWC in memory, as a host fallback
    recipes = [v2.Compose([v2.Resize(40), v2.RandomCrop(32), v2.RandomHorizontalFlip()]),
               v2.Compose([v2.Resize(40), v2.CenterCrop(32)]),
               v2.Compose([v2.RandomResizedCrop(32), v2.RandomHorizontalFlip()]),
               v2.Compose([v2.RandomCrop(32), v2.RandomHorizontalFlip()])]
    torch.manual_seed(0)
    for recipe in recipes:
        plan = BoxPlan.of(recipe)
        for min_side in (None, 30):  # 30: DCT-scaled boxes (1/2) for the recipes without a Resize
            rows = np.array([plan.draw(tuple(image.shape[1:]), min_side) for image in images], dtype=np.int64)
            assert 0 < rows[:, FLIP].sum() < len(rows) or plan.flip is None
            alone = torch.cat([place([image], rows[i:i + 1]) for i, image in enumerate(images)])
            assert torch.equal(place(list(images), rows), alone)


def test_large_images_resize_in_groups_bounded_by_bytes_with_the_same_pixels():
    """On CUDA F.resize casts a stacked group to float32: a group of 32 12 MP photos would be a 4.7 GB copy. The group
    shrinks with the image (one at a time for 12 MP), and an image placed in a smaller group is placed as alone."""
    def of(height: int, width: int) -> torch.Tensor:
        return torch.zeros((), dtype=torch.uint8).expand(3, height, width)

    assert resize_group(of(3024, 4032)) == 1 and resize_group(of(1024, 1024)) == 21 and resize_group(of(256, 256)) == 32
    generator = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 1200, 1600), dtype=torch.uint8, generator=generator) for _ in range(12)]
    assert resize_group(images[0]) == 11  # two groups of this size: 11, then 1
    plan = BoxPlan.of(v2.Compose([v2.Resize(40), v2.RandomCrop(32), v2.RandomHorizontalFlip()]))
    torch.manual_seed(0)
    rows = np.array([plan.draw(tuple(image.shape[1:]), None) for image in images], dtype=np.int64)
    alone = torch.cat([place([image], rows[i:i + 1]) for i, image in enumerate(images)])
    assert torch.equal(place(list(images), rows), alone)


def test_a_ring_slot_holds_a_typical_batch_not_a_batch_of_the_largest_file():
    """Slots of 2 x the largest probed file x the batch needed ~120 GB of /dev/shm for 12 MP photos at the a100
    profile. A slot is 1.5 x a batch of the mean file, at least the largest file, at most a few hundred MB; a batch
    that does not fit takes the plain collate (tests/test_shm_ring.py)."""
    photos = [1_400_000 + 10_000 * n for n in range(63)]  # 1.4-2 MB, as data/photos-12mp
    typical = 128 * sum(photos) / len(photos)
    assert 1.2 * typical < slot_bytes(photos, 128) <= SLOT_CAP_BYTES <= 512 << 20
    assert slot_bytes([*photos, 900_000_000], 128) == SLOT_CAP_BYTES, "one huge outlier: bounded"
    small = [100_000] * 63 + [20_000_000]
    assert slot_bytes(small, 32) == 20_000_000, "the outlier alone fits, a batch of it does not (1.28 GB)"
    assert slot_bytes(small, 1) == max(small), "batch size 1: the largest file fits"


def jpeg(seed: int, size: tuple[int, int] = (48, 64)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def encoded_batch(files: list[bytes]) -> Encoded:
    plan = BoxPlan.of(v2.CenterCrop(16))
    return Encoded.join([EncodedSample(data, plan.draw((48, 64), None)) for data in files])


def test_a_device_that_refuses_every_file_of_its_first_batch_fails_in_one_line(caplog):
    """An nvJPEG that cannot start refuses every file: the run fails naming torchcodec's reason, rather than
    decoding every batch on the CPU in the main thread, and warns once before."""
    def cannot_start(files, device):
        raise RuntimeError("Failed to initialize nvjpeg with hardware backend: 5\n  (from DecodeJpegCuda.cpp:219)")

    decoder = DeviceDecoder(CPU)
    decoder.decode_jpeg = cannot_start
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as err:
        decoder(encoded_batch([jpeg(seed) for seed in range(3)]))
    assert str(err.value) == ("data.decode=device cannot decode on cpu: Failed to initialize nvjpeg with hardware "
                              "backend: 5; use data.decode=cpu")
    assert [r.getMessage() for r in caplog.records if "torchcodec refused" in r.getMessage()] == [
        "data.decode=device: torchcodec refused a file on cpu (Failed to initialize nvjpeg with hardware backend: 5); "
        "such files are decoded on the CPU (decode_fallbacks in metrics.jsonl)"]


def test_files_refused_after_the_device_decoded_fall_back_with_the_reason_logged_once(caplog):
    """Once the device has decoded, a file it refuses is decoded on the host (the same pixels) and counted; the
    first reason is logged, once over the batches."""
    files = [jpeg(seed) for seed in range(5)]
    real = DeviceDecoder(CPU)
    want, fallbacks, unreadable = real(encoded_batch(files))
    assert fallbacks == 0 and not unreadable

    def refusing_file_2(batch, device):
        if any(bytes(f.numpy()) == files[2] for f in (batch if isinstance(batch, list) else [batch])):
            raise RuntimeError("nvjpegDecode failed: 7 (NVJPEG_STATUS_JPEG_NOT_SUPPORTED)")
        return real.decode_jpeg(batch, device=device)

    decoder = DeviceDecoder(CPU)
    decoder.decode_jpeg = refusing_file_2
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            images, fallbacks, unreadable = decoder(encoded_batch(files))
            assert torch.equal(images, want) and fallbacks == 1 and not unreadable
    assert sum("torchcodec refused a file on cpu (nvjpegDecode failed: 7" in r.getMessage()
               for r in caplog.records) == 1


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("raised", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.50 GiB"),
                                    RuntimeError("torch_empty_strided API call failed at shim_utils.h, line 18")])
def test_out_of_memory_in_the_decoder_is_raised_not_decoded_on_the_host(batched, raised, monkeypatch, caplog):
    """torch.OutOfMemoryError is a RuntimeError: swallowed, a batched OOM became a decode per file on the host.
    torchcodec's stable ABI hands it back as a plain RuntimeError, which counts on a nearly full GPU (what the
    device's memory query says there, installed here from outside)."""
    monkeypatch.setattr("loadout.data.fast.encoded.gpu_nearly_full", lambda: True)

    def out_of_memory(files, device):
        if isinstance(files, list) and not batched:
            raise RuntimeError("nvjpegDecodeBatched failed")
        raise raised

    decoder = DeviceDecoder(CPU)
    decoder.decode_jpeg = out_of_memory
    with caplog.at_level(logging.WARNING), pytest.raises(torch.OutOfMemoryError):
        decoder(encoded_batch([jpeg(seed) for seed in range(3)]))
    assert not caplog.records


def test_an_orientation_torchcodec_did_not_apply_sends_the_file_to_the_host():
    row = np.array(BoxPlan.of(v2.CenterCrop(8)).draw((48, 64), None, 6))
    upright = torch.zeros(3, 64, 48, dtype=torch.uint8)
    assert tuple(as_stored(upright, row).shape) == (3, 48, 64)
    assert as_stored(torch.zeros(3, 48, 64, dtype=torch.uint8), row) is None  # decoded as stored: not turned


def test_refused_files_fall_back_to_the_cpu_counted_and_broken_ones_are_skipped(tiny_dataset, tmp_path):
    root = tmp_path / "mixed"
    shutil.copytree(tiny_dataset, root)
    folder = root / "train" / "circle"
    Image.open(folder / "00000.jpg").save(folder / "00000.png")  # not a JPEG: the device decoder refuses it
    (folder / "00000.jpg").unlink()
    (folder / "00001.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")  # no header: skipped in the worker
    whole = (folder / "00002.jpg").read_bytes()
    (folder / "00002.jpg").write_bytes(whole[:len(whole) * 3 // 5])  # a whole header, a cut body: skipped after both
    cfg = config(root, "data.num_workers=2", "data.decode=device", "data.sampler=sequential", "data.drop_last=false")
    train, _, _ = epoch(cfg)
    assert sum(b[2] for b in train) == 2, "both broken files skipped and counted"
    assert sum(b[3] for b in train) == 1, "the PNG decoded on the CPU, counted"
    assert sum(len(b[1]) for b in train) == 238 and all(len(b[0]) == len(b[1]) for b in train)


def test_resume_mid_epoch_gives_exactly_the_remaining_batches(tiny_dataset):
    whole, rest = whole_and_resumed(config(tiny_dataset, "data.num_workers=2", "data.decode=device"), 1, taken=4)
    assert len(whole) == 15 and len(rest) == 11
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(rest, whole[4:], strict=True))


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.decode=device", "data.device_transforms=false"], "set data.device_transforms=true"),
    (["data.decode=device", "data.cache_bytes=1000"], "data.cache_bytes=1000: the sample cache holds CPU-decoded"),
])
def test_settings_that_cannot_decode_on_the_device_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(compose_config(overrides))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("extra", "message"), [
    (["augment=strong"], "data.decode=device: the device runs [Resize ->] RandomCrop"),
    (["dataset=cifar10"], "data.decode=device: Cifar10Dataset offers no `read_encoded`"),
])
def test_sources_and_recipes_it_cannot_run_fail_before_any_worker(tiny_dataset, cifar_root, extra, message):
    root = cifar_root if "dataset=cifar10" in extra else tiny_dataset
    with pytest.raises(ConfigError) as err:
        data_from_config(config(root, "data.decode=device", "data.num_workers=2", *extra), DistEnv(), CPU)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.fixture
def unloadable_torchcodec(tmp_path) -> str:
    """A PYTHONPATH whose `torchcodec` fails as one built for another CUDA major does: torch.ops.load_library raises
    OSError, not ImportError."""
    fake = tmp_path / "site" / "torchcodec"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise OSError("libnvrtc.so.13: cannot open shared object file")\n')
    return f"{fake.parent}{os.pathsep}{ROOT}"


@pytest.mark.slow
def test_a_torchcodec_that_does_not_load_is_one_line(small_run_args, unloadable_torchcodec):
    result = run_cli([*small_run_args, "data.decode=device", "data.num_workers=0"],
                     env={"PYTHONPATH": unloadable_torchcodec}, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: data.decode=device: torchcodec does not load (libnvrtc.so.13: cannot open")
    assert "torch >= 2.11" in lines[0] and "data.decode=cpu" in lines[0]


@pytest.mark.slow
@pytest.mark.skipif(torch.version.cuda is None, reason="docker/check_torch.py loads torchcodec in CUDA images only")
def test_the_image_build_checks_that_torchcodec_loads(unloadable_torchcodec):
    """docker/check_torch.py, as the Dockerfile runs it: the lock's torch fails the build in one line; a base's own
    torch (TORCH_FROM_BASE=1) only warns, since the lock's torchcodec may not be built for it."""
    def check(**env) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "docker/check_torch.py", "constraints.txt", "requirements.txt"],
                              cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})

    assert check().returncode == 0, "the real torchcodec loads"
    refused = check(PYTHONPATH=unloadable_torchcodec)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert refused.stderr.startswith("check_torch: torchcodec does not load against torch ")
    assert "libnvrtc.so.13" in refused.stderr
    warned = check(PYTHONPATH=unloadable_torchcodec, TORCH_FROM_BASE="1")
    assert warned.returncode == 0 and warned.stderr.startswith("check_torch: warning: torchcodec does not load")


@pytest.mark.slow
def test_a_run_trains_with_device_decode(small_run_args, tmp_path):
    result = run_cli([*small_run_args, "data.num_workers=2", "data.decode=device", "trainer.epochs=2",
                      "trainer.max_steps=20"])
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert len(records) == 2 and records[-1]["decode_fallbacks"] == 0 and records[-1]["val_samples"] == 80


@pytest.fixture(scope="module")
def phone_photos(tmp_path_factory) -> Path:
    """240 x 180 photos, each re-saved with an EXIF orientation 1-8 in turn (6: a phone held upright, "rotate 90 CW
    to display")."""
    root = make_synthetic_imagefolder(tmp_path_factory.mktemp("phone"), train_per_class=4, val_per_class=2,
                                      photo=(240, 180))
    for n, path in enumerate(sorted(root.glob("*/*/*.jpg"))):
        tag_orientation(path, 6 if n % 3 == 0 else 1 + n % 8)  # a third of them 6, the common one
    return root


@pytest.mark.parametrize("recipe", ["crop_flip", "imagenet"])
@pytest.mark.slow
def test_exif_rotated_photos_give_the_pixels_of_a_cpu_decoded_run(phone_photos, recipe):
    """torchcodec turns a JPEG upright by its EXIF orientation; the CPU path keeps pixels as stored (decode.py). The
    device path undoes the turn before its crops, so the boxes drawn on the stored size land on the same pixels: no
    rotated, squashed or mirrored image, and no empty slice with imagenet's RandomResizedCrop. Decoded whole on both
    paths (no DCT scaling): the same pixels, bit for bit."""
    common = (f"augment={recipe}", "data.batch_size=8", "data.drop_last=false", "data.scaled_decode=false")
    cpu, cpu_val, _ = epoch(config(phone_photos, *common, "data.num_workers=0"))
    device, device_val, _ = epoch(config(phone_photos, *common, "data.num_workers=2", "data.decode=device"))
    assert len(cpu) == len(device) == 5 and len(cpu_val) == len(device_val) == 3
    for (a, labels_a, _, _), (b, labels_b, _, fallbacks) in zip(cpu, device, strict=True):
        assert torch.equal(labels_a, labels_b) and fallbacks == 0, "decoded by torchcodec, not the CPU fallback"
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(cpu_val, device_val, strict=True))


@pytest.mark.parametrize("recipe", ["crop_flip", "imagenet"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA here (make gpu-check on a GPU)")
def test_exif_rotated_photos_decoded_on_cuda_match_a_cpu_decoded_run(phone_photos, recipe):
    """torchcodec's CUDA decoder reads the EXIF tag with its own APP1 scan, not libjpeg's markers as on the CPU. A tag
    it reads otherwise than PIL is a host fallback for orientations 5-8 (the shape differs) and, for 2-4, a mirrored
    or flipped sample: tens of levels off (at least 9 on these photos). nvJPEG's IDCT and CUDA's float resize round
    otherwise than libjpeg-turbo and the CPU's uint8 resize: each sample within a few levels."""
    assert {exif_orientation(path.read_bytes()) for path in phone_photos.glob("*/*/*.jpg")} == set(range(1, 9))
    common = (f"augment={recipe}", "data.batch_size=8", "data.drop_last=false", "data.scaled_decode=false")
    cpu, cpu_val, _ = epoch(config(phone_photos, *common, "data.num_workers=0"))
    device, device_val, _ = epoch(config(phone_photos, *common, "data.num_workers=2", "data.decode=device"),
                                  device=CUDA)
    assert len(cpu) == len(device) == 5 and len(cpu_val) == len(device_val) == 3
    for (_, labels_a, _, _), (_, labels_b, _, fallbacks) in zip(cpu, device, strict=True):
        assert torch.equal(labels_a, labels_b) and fallbacks == 0, "decoded by nvJPEG, not the CPU fallback"
    pairs = [(a[0], b[0]) for a, b in zip(cpu, device, strict=True)] + list(zip(cpu_val, device_val, strict=True))
    for a, b in pairs:
        error = (pixels(a) - pixels(b)).abs().mean(dim=(1, 2, 3))  # per sample
        assert float(error.max()) < 3, error.tolist()
