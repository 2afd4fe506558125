#!/usr/bin/env python3
"""A long run stays flat (`make soak`): many short epochs of `python -m train` with persistent workers, and after
each one the training process's and its workers' PSS, open files and threads (bench/soak_probe.py, a callback
installed from outside). Prints the growth over the second half of the run (after warm-up), and after the run ends
checks that nothing is left behind: no process of the run, no new /dev/shm entry, no run dir lock.

Targets: PSS grows < 1 MiB an epoch, open files and threads not at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from common import DATA, ROOT, machine, report

EPOCHS = int(os.environ.get("SOAK_EPOCHS", 40))
SHM = Path("/dev/shm")


def slope(rows: list[dict], key: str) -> float:
    """Least-squares growth of `key` per epoch."""
    xs, ys = [r["epoch"] for r in rows], [r[key] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / max(sum((x - mx) ** 2 for x in xs), 1e-9)


def main() -> int:
    shm_before = set(os.listdir(SHM)) if SHM.is_dir() else set()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        args = [sys.executable, "-m", "train", "hardware=cpu", f"data.root={DATA}", "data.image_size=32",
                "data.batch_size=64", "data.num_workers=2", "data.persistent_workers=true", "model.name=resnet18",
                f"trainer.epochs={EPOCHS}", "trainer.max_steps=null", "trainer.progress=false",
                "+callbacks.soak._target_=soak_probe.ResourceLog", f"hydra.run.dir={run_dir}"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "bench")])}
        start = time.perf_counter()
        process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True)
        pid = process.pid
        _, stderr = process.communicate()
        if process.returncode != 0:
            print(f"soak: the run failed: {stderr.strip().splitlines()[-1:]}")
            return 1
        elapsed = time.perf_counter() - start
        rows = [json.loads(line) for line in (run_dir / "resources.jsonl").read_text().splitlines()]
        lock_left = (run_dir / "run.lock").exists()
    time.sleep(1)
    left = [p.pid for p in psutil.process_iter(["ppid"]) if p.info["ppid"] == pid]
    shm_new = sorted((set(os.listdir(SHM)) if SHM.is_dir() else set()) - shm_before)
    late = rows[len(rows) // 2:]
    pss, files, threads = slope(late, "pss_mb"), slope(late, "open_files"), slope(late, "threads")
    detail = (f"{len(rows)} epochs in {elapsed:.0f} s; PSS {rows[0]['pss_mb']:.0f} -> {rows[-1]['pss_mb']:.0f} MiB, "
              f"open files {rows[0]['open_files']} -> {rows[-1]['open_files']}, threads {rows[0]['threads']} -> "
              f"{rows[-1]['threads']}, workers {rows[-1]['workers']}; {machine()}")
    report("soak: PSS growth over the second half (MiB/epoch)", pss, "< 1", pss < 1, detail)
    report("soak: open-file growth over the second half (per epoch)", files, "< 0.1", files < 0.1, detail)
    report("soak: thread growth over the second half (per epoch)", threads, "< 0.1", threads < 0.1, detail)
    clean = not left and not shm_new and not lock_left
    print(f"soak: after exit: processes left {left or 'none'}, new /dev/shm entries {shm_new or 'none'}, run dir lock "
          f"{'LEFT' if lock_left else 'gone'} {'PASS' if clean else 'FAIL'}")
    return 0 if clean and pss < 1 and files < 0.1 and threads < 0.1 else 1


if __name__ == "__main__":
    sys.exit(main())
