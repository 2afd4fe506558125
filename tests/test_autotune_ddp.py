"""data.autotune under DDP (loadout/data/loader/autotune.py): with real torchrun, two gloo ranks and real workers, ranks
whose own choices differ (their cores' shares differ, and their findings) apply one agreed choice, at the same batch
within a long first epoch and after an epoch.

This file is also each rank's program: torchrun runs it with the data root and an output folder; each rank writes
what it decided and applied to rank<R>.json."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from loadout.data.datasets import ImageFolderDataset

CPU = torch.device("cpu")


class SlowReads(ImageFolderDataset):
    """A folder on a slow disk: every read waits 5 ms before the file comes (the loader is the bound)."""

    def read_encoded(self, index: int) -> tuple[bytes, int]:
        time.sleep(0.005)
        return super().read_encoded(index)


def rank_main(root: str, out_dir: str) -> None:
    from loadout.data.loader.autotune import Autotune
    from loadout.dist import DistEnv, destroy_process_group, init_process_group
    from loadout.observe.doctor import Doctor, Finding, Machine
    from loadout.observe.meter import EpochMeter
    from tests.conftest import compose_config
    from train.job import data_from_config

    env = DistEnv.from_env()
    init_process_group(env, CPU)
    cfg = compose_config(["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=1",
                          "data.num_workers=0", "data.prefetch_factor=1", "trainer.epochs=2",
                          "dataset._target_=tests.test_autotune_ddp.SlowReads"])
    notes: dict = {}
    with data_from_config(cfg, env, CPU) as data:
        # the cores differ: 1 worker on rank 0 (2 cores / 2 processes: the core its main process leaves free), 3-4
        # on rank 1 (8 / 2)
        tune = Autotune(data, env, cores=2 if env.rank == 0 else 8)
        doctor = Doctor(Machine(cores=4, num_workers=0))
        meter = EpochMeter(CPU)
        data.set_epoch(0)
        per_epoch = len(data.train)
        for number, batch in enumerate(data.train, start=1):
            meter.waited()
            time.sleep(0.001)  # the step
            meter.stepped(len(batch))
            change = tune.during_epoch(number, per_epoch, meter, doctor)
            if change is not None:
                notes["within"] = [number, change.num_workers, change.prefetch_factor]
        notes["batches"] = number
        notes["loader_workers"] = data.train.loader.num_workers
        # after an epoch: rank 0's finding asks 2 workers, rank 1's asks 5; each may start 9 (24 cores / 2)
        wide = Autotune(data, env, cores=24)
        asked = 2 if env.rank == 0 else 5
        change = wide.after_epoch(Finding("read/fetch", "workers", 0.5, worker_s=asked * 0.001, step_s=0.001))
        notes["after"] = None if change is None else [change.num_workers, change.prefetch_factor]
        notes["plan"] = [data.plan.num_workers, data.plan.prefetch_factor, data.train.loader.num_workers]
    (Path(out_dir) / f"rank{env.rank}.json").write_text(json.dumps(notes))
    destroy_process_group()


@pytest.mark.slow  # torchrun, two ranks
def test_both_ranks_apply_the_same_choice_within_the_epoch_and_after_it(tiny_dataset, tmp_path):
    from tests.test_distributed import torchrun

    result = torchrun([str(tiny_dataset), str(tmp_path)], tmp_path, entry=(str(Path(__file__).resolve()),),
                      timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1], ranks
    notes = ranks[0]
    assert notes["batches"] == 120  # 240 samples, 2 ranks, batches of 1: the epoch ran to its end after the change
    assert notes["within"] == [20, 1, 2], notes  # WARMUP + WINDOW batches; rank 0's 1 worker, not rank 1's 3-4
    assert notes["loader_workers"] == 1
    assert notes["after"] == [2, 2] and notes["plan"] == [2, 2, 2], notes  # the smaller of 2 and 5


if __name__ == "__main__":
    rank_main(*sys.argv[1:3])
