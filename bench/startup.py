#!/usr/bin/env python3
"""Start-up: `python -m train` from the process start to its first training step, against what any start pays.

Each command is a fresh interpreter, timed from just before it starts to the first batch handed to the train step
(this file's FirstStep, a callback installed from outside): wall seconds, and the CPU seconds of the main process,
which other jobs on a shared box inflate far less (the ratios are of those). The run is the one `make train` makes,
cut short (hardware=cpu, the embedded dataset, the default logger, trainer.limit_batches=1). Interleaved over ROUNDS:

- loadout: `python -m train` as typed;
- eager: the same run in an interpreter that first imports what only some runs need (the trackers' libraries, timm,
  prometheus_client, the profiler, the remote stores' libraries, those installed): what each start would pay were
  they imported at the top, as they were before;
- floor: `import torch, torchvision, hydra` and nothing else: what any start pays before loadout's first line
  (torchvision's ops import torch._dynamo, and with it sympy and triton).

`--baseline DIR`: also time `python -m train` from another checkout (e.g. `git worktree add /tmp/before <commit>`),
same interpreter, same rounds. Targets: loadout <= eager (imported lazily, they cost a run that does not use them
nothing), loadout - floor <= 0.5 CPU seconds (what loadout itself adds: Hydra's composition, twice (the command line
is checked before Hydra starts), the data and model built, the workers started). Each process's wall time to its exit
is printed too: an interpreter holding torch spends over a second collecting garbage at exit unless the imports'
objects are frozen (train/__main__.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROUNDS = 3
OPTIONAL = ("torch.utils.tensorboard", "prometheus_client", "torch.profiler", "mlflow", "wandb", "timm", "pyarrow",
            "s3fs", "matplotlib.pyplot")
PRELOAD_THEN_TRAIN = ("import importlib, runpy, sys\n"
                      "for name in sys.argv[1].split(','): importlib.import_module(name)\n"
                      "sys.argv = ['train', *sys.argv[2:]]\n"
                      "runpy.run_module('train', run_name='__main__', alter_sys=True)")


class FirstStep:
    """Writes the wall-clock time and this process's CPU seconds at the first batch handed to the train step to
    $STARTUP_PROBE."""

    def on_train_batch(self, trainer, batch) -> None:
        path = Path(os.environ["STARTUP_PROBE"])
        if not path.exists():
            path.write_text(f"{time.time()!r} {time.process_time()!r}")


def run_args(data: Path, run_dir: Path) -> list[str]:
    return ["hardware=cpu", f"data.root={data}", "trainer.max_steps=1", "trainer.limit_batches=1",
            "trainer.progress=false", "+callbacks.startup._target_=startup.FirstStep", f"hydra.run.dir={run_dir}"]


def seconds_to_first_step(command: list[str], cwd: Path, tmp: Path) -> tuple[float, float, float]:
    """Wall seconds from just before `command` starts to its first training step (it must train), its CPU seconds
    by then, and wall seconds to its exit (the process's teardown included)."""
    probe = tmp / f"probe-{time.monotonic_ns()}"
    env = {**os.environ, "STARTUP_PROBE": str(probe),
           "PYTHONPATH": os.pathsep.join([str(cwd), str(Path(__file__).resolve().parent)])}
    start = time.time()
    done = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0 or not probe.exists():
        raise SystemExit(f"startup: {' '.join(command[:4])} ... failed (exit {done.returncode}): "
                         f"{done.stderr.strip().splitlines()[-1:]}")
    ended = time.time()
    wall, cpu = map(float, probe.read_text().split())
    return wall - start, cpu, ended - start


def seconds_to_import(modules: str) -> tuple[float, float, float]:
    start = time.time()
    done = subprocess.run([sys.executable, "-c", f"import time, {modules}; print(time.time(), time.process_time())"],
                          check=True, capture_output=True, text=True)
    imported, cpu = map(float, done.stdout.split())
    return imported - start, cpu, time.time() - start


def main() -> int:
    from common import DATA, ROOT, machine, report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout whose `python -m train` to time alike")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    optional = [name for name in OPTIONAL if importlib.util.find_spec(name.partition(".")[0]) is not None]
    times: dict[str, list[tuple[float, float, float]]] = {"loadout": [], "eager": [], "floor": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for round_ in range(args.rounds):
            train = run_args(DATA, tmp / f"run{round_}")
            times["loadout"].append(seconds_to_first_step([sys.executable, "-m", "train", *train], ROOT, tmp))
            eager = [sys.executable, "-c", PRELOAD_THEN_TRAIN, ",".join(optional), *run_args(DATA, tmp / f"e{round_}")]
            times["eager"].append(seconds_to_first_step(eager, ROOT, tmp))
            times["floor"].append(seconds_to_import("torch, torchvision, hydra.main"))
            if args.baseline:
                before = [sys.executable, "-m", "train", *run_args(DATA, tmp / f"b{round_}")]
                times["baseline"].append(seconds_to_first_step(before, args.baseline.resolve(), tmp))
    wall, cpu, whole = ({name: statistics.median(row[at] for row in rows) for name, rows in times.items() if rows}
                        for at in range(3))
    shown = ", ".join(f"{name} {wall[name]:.2f} s wall / {cpu[name]:.2f} s CPU ({whole[name]:.2f} s to exit)"
                      for name in wall)
    detail = f"medians of {args.rounds}: {shown}; eager preloads {', '.join(optional)}; {machine()}"
    lazy = cpu["loadout"] / cpu["eager"]
    report("startup: CPU seconds to the first step, loadout over eager imports", lazy, "<= 1.00", lazy <= 1.0, detail)
    added = cpu["loadout"] - cpu["floor"]
    report("startup: CPU seconds loadout adds to importing torch, torchvision, hydra", added, "<= 0.5", added <= 0.5,
           detail)
    if args.baseline:
        print(f"startup: CPU seconds to the first step, this checkout over {args.baseline}: "
              f"{cpu['loadout'] / cpu['baseline']:.2f} (wall {wall['loadout'] / wall['baseline']:.2f})  [{detail}]")
    return 0 if lazy <= 1.0 and added <= 0.5 else 1


if __name__ == "__main__":
    sys.exit(main())
