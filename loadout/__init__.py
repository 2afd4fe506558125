"""loadout: the loader and run machinery of the training template in train/, importable on its own.

- data/     sources (ImageFolder, VOC, mixes, tar shards, parquet, HDF5, LMDB, packed), the per-sample path, the
            loader (plan, shared-memory batch ring, stage clocks, autotune, exact positions) and the device prefetcher
- observe/  the metric vocabulary, the epoch meter, the doctor's diagnosis, memory, Prometheus and trackers
- runtime/  precision, out-of-memory recovery, non-finite losses, stop signals, atomic checkpoints
- run/      the harness around a run: resume replay, run dirs and their lock, the run record, lost peers
- tune/     `make tune`'s report and profile, the measured CPU precision
- errors.py, dist.py, device.py, build.py, credentials.py: the floor the rest stands on

loadout never imports train/ (tests/test_layering.py holds the rule): the template hands in its parts.
"""
