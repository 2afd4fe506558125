"""A callback bench/soak.py installs from outside (`+callbacks.soak._target_=soak_probe.ResourceLog`): after every
epoch, the training process's and its workers' PSS, open files and threads, appended to <run dir>/resources.jsonl."""

from __future__ import annotations

import json

import psutil


class ResourceLog:
    def on_epoch_end(self, trainer, record: dict) -> None:
        if not trainer.env.is_main:
            return
        sample = trainer.memory.sample()
        processes = [psutil.Process(), *psutil.Process().children(recursive=True)]
        fds = threads = 0
        for process in processes:
            try:
                fds, threads = fds + process.num_fds(), threads + process.num_threads()
            except psutil.NoSuchProcess:
                continue
        row = {"epoch": record["epoch"], "pss_mb": sample.total_pss / 2**20, "open_files": fds, "threads": threads,
               "workers": len(sample.workers)}
        with open(trainer.run_dir / "resources.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
