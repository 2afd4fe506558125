#!/usr/bin/env python3
"""The memory a shard index costs: the node's PSS (main process + 2 workers) over one epoch of 20,000 small images
in 10,000 shards against the same images in 100 shards (target: 10,000 shards cost < 50 MB more per node).

With sample counts from _info.json nothing but one offset per shard is held for the whole dataset; a worker builds
a shard's index when it first reads it and keeps the last few (shards.ShardSource.INDEXES_HELD), so memory does not
grow with the number of shards, and the workers share what the main process holds.
"""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
from pathlib import Path

import numpy as np
from common import host_batches, machine, pipeline, report
from PIL import Image

from loadout.errors import MIB
from loadout.observe.memory import worker_memory

SAMPLES, CLASSES = 20_000, 10


def write_shards(out: Path, shards: int) -> Path:
    """SAMPLES 32 px JPEGs (one per class, repeated) as `shards` tar shards with an _info.json."""
    images = []
    for label in range(CLASSES):
        buffer = io.BytesIO()
        Image.fromarray(np.full((32, 32, 3), 25 * label, dtype=np.uint8)).save(buffer, "JPEG")
        images.append(buffer.getvalue())
    per_shard = SAMPLES // shards
    splits = {}
    for split, count in (("train", shards), ("val", 1)):
        (out / split).mkdir(parents=True)
        names = []
        for shard in range(count):
            names.append(f"{split}/shard-{shard:06d}.tar")
            with tarfile.open(out / names[-1], "w") as tar:
                for sample in range(per_shard):
                    key = f"{shard:06d}{sample:05d}"
                    for suffix, data in (("jpg", images[sample % CLASSES]), ("cls", str(sample % CLASSES).encode())):
                        info = tarfile.TarInfo(f"{key}.{suffix}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
        splits[split] = {"filenames": names, "shard_lengths": [per_shard] * count}
    (out / "_info.json").write_text(json.dumps({"classes": [str(c) for c in range(CLASSES)], "splits": splits}))
    return out


def node_pss(root: Path, cache: Path) -> float:
    """The largest PSS of the main process plus its workers over an epoch, in MiB."""
    import psutil

    main = psutil.Process()
    peak = 0
    with pipeline("dataset=shards", "data.num_workers=2", "data.batch_size=256", "data.image_size=32",
                  "data.persistent_workers=true", "trainer.epochs=1", f"dataset.cache_dir={cache}",
                  root=root) as data:
        for _ in host_batches(data, 0):
            workers = sum(memory.pss for memory in worker_memory().values())
            peak = max(peak, main.memory_full_info().pss + workers)
    return peak / MIB


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        few, many = write_shards(tmp / "few", 100), write_shards(tmp / "many", 10_000)
        small, large = node_pss(few, tmp / "cache-few"), node_pss(many, tmp / "cache-many")
        report("node PSS, 10,000 shards - 100 shards (MiB)", large - small, "< 50", large - small < 50,
               f"{large:.0f} vs {small:.0f} MiB (main + 2 workers), {SAMPLES} images; {machine()}")
