#!/usr/bin/env python3
"""dataset=hdf5 and dataset=lmdb against the layouts they replace, the same images in one run, A B A B:

    encoded HDF5 / the same JPEGs as an ImageFolder   >= 1.0 (the same decode, less the file opens)
    LMDB / the same JPEGs as an ImageFolder           >= 1.0
    pixel HDF5 / the packed format                    >= 0.9 (the same squares; both crop whole batches)
    2 workers / 1 reading one HDF5 file               >= 1.8 on a data-bound run (320 px JPEGs, Resize 256 ->
                                                      RandomCrop 224), beside a folder's 2 / 1 in the same rounds

scripts/convert_dataset.py writes the HDF5 files and the LMDB environments, scripts/pack_dataset.py the packed set.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from common import DATA, ROOT, SEED_DATA, interleaved, machine, pipeline, report, steady_images_per_s

SETTINGS = ("data.num_workers=2", "data.batch_size=64")  # the cpu profile's 64 px crops
TIMED_EPOCHS = 6  # after the warm-up, in one stream: one epoch of these 64 px crops is too short to time
SIZE = 73  # their resize size: the packed and pixel squares are stored at it


def script(name: str, *args) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / name), *map(str, args)], check=True, capture_output=True)


def rate(root: Path, *overrides: str) -> float:
    with pipeline(*SETTINGS, f"trainer.epochs={TIMED_EPOCHS + 1}", *overrides, root=root) as data:
        return steady_images_per_s(data)


def workers_rate(root: Path, workers: int, *overrides: str) -> float:
    with pipeline(f"data.num_workers={workers}", "trainer.epochs=3", "data.batch_size=32", "data.image_size=224",
                  *overrides, root=root) as data:
        return steady_images_per_s(data)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        script("convert_dataset.py", DATA, tmp / "encoded.h5", "--to", "hdf5")
        script("convert_dataset.py", DATA, tmp / "lmdb", "--to", "lmdb")
        script("convert_dataset.py", DATA, tmp / "pixels.h5", "--to", "hdf5", "--pixels", SIZE)
        script("pack_dataset.py", DATA, tmp / "packed", "--size", SIZE)
        script("convert_dataset.py", SEED_DATA, tmp / "seed.h5", "--to", "hdf5")
        hdf5, folder = interleaved(lambda: rate(tmp / "encoded.h5", "dataset=hdf5"), lambda: rate(DATA), rounds=5)
        lmdb, folder_again = interleaved(lambda: rate(tmp / "lmdb", "dataset=lmdb"), lambda: rate(DATA), rounds=5)
        pixels, packed = interleaved(lambda: rate(tmp / "pixels.h5", "dataset=hdf5"),
                                     lambda: rate(tmp / "packed", "dataset=packed"), rounds=5)
        two, one = interleaved(lambda: workers_rate(tmp / "seed.h5", 2, "dataset=hdf5"),
                               lambda: workers_rate(tmp / "seed.h5", 1, "dataset=hdf5"), rounds=3)
        folder_two, folder_one = interleaved(lambda: workers_rate(SEED_DATA, 2), lambda: workers_rate(SEED_DATA, 1),
                                             rounds=2)
    where = f"2 workers, batch 64, 64 px crops of {DATA.name}; {machine()}"
    report("encoded HDF5 / ImageFolder img/s", hdf5 / folder, ">= 1.0", hdf5 / folder >= 1.0,
           f"{hdf5:.0f} vs {folder:.0f} img/s, {where}")
    report("LMDB / ImageFolder img/s", lmdb / folder_again, ">= 1.0", lmdb / folder_again >= 1.0,
           f"{lmdb:.0f} vs {folder_again:.0f} img/s, {where}")
    report("pixel HDF5 / packed img/s", pixels / packed, ">= 0.9", pixels / packed >= 0.9,
           f"{pixels:.0f} vs {packed:.0f} img/s, {SIZE} px squares, {where}")
    report("one HDF5 file, 2 workers / 1", two / one, ">= 1.8", two / one >= 1.8,
           f"{two:.0f} vs {one:.0f} img/s; a folder of the same JPEGs {folder_two / folder_one:.2f} "
           f"({folder_two:.0f} vs {folder_one:.0f}); {SEED_DATA.name}, Resize 256 -> RandomCrop 224; {machine()}")


if __name__ == "__main__":
    main()
