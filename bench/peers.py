#!/usr/bin/env python3
"""`make bench-peers`: loadout beside the data loaders users pick instead (DALI CPU-only, FFCV, litdata,
mosaicml-streaming, stock torchvision), on scripts/make_photos.py's real photos with one recipe (RandomResizedCrop
224 + flip, uint8 batches of 64), one CPU budget (2 worker processes or 2 threads), epoch 2 of 2 timed, every loop
only touching its batches (bench/peer_loaders.py builds the peers).

Every row is a fresh process, so each pays its own start-up outside the timed epoch and none inherits another's
state: the peers under their own venv (.venv-peers, which the Makefile makes: mosaicml-streaming needs numpy < 2.2,
the lock holds 2.4.6), loadout under this one. Rounds run the rows in turn, reversed every other round, and each row
keeps its best (a shared machine slows whatever runs while it is busy; ROUNDS=n for more; the median is printed
beside it). Printed: the table, loadout end to end first, and three ratios with their targets (issue 47): end to end
/ pipeline alone >= 0.9, end to end / the best peer >= 1.0, pipeline alone / the best peer >= 1.15. A missed target
is reported, not a failure; a peer that cannot run stays in the table with the reason in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT, first_epoch, host_batches, machine, pipeline, report, spread
from peer_loaders import BATCH, EPOCHS, SIZE, WORKERS, epoch_rate
from real_photos import REAL_DATA, photo_files

from loadout.data.loader.workers import one_torch_thread

ROUNDS = int(os.environ.get("ROUNDS", 2))
PEERS_PYTHON = Path(os.environ.get("PEERS_PYTHON", ROOT / ".venv-peers" / "bin" / "python"))
CACHE = ROOT / "data" / "peers-cache" / REAL_DATA.name  # each peer's converted copy, written once
KIT = ("dataset=imagefolder", "augment=imagenet", f"data.image_size={SIZE}", f"data.batch_size={BATCH}",
       f"data.num_workers={WORKERS}", f"trainer.epochs={EPOCHS}")
E2E, PIPELINE = "loadout end to end", "loadout's pipeline alone"
# row -> (the peer's name in peer_loaders.PEERS, how it is used)
PEERS = {
    "torchvision": ("torchvision", "ImageFolder + v2 + DataLoader"),
    "litdata": ("litdata", "StreamingDataset, torchvision decode"),
    "FFCV": ("ffcv", "RandomResizedCropRGBImageDecoder, its own .beton"),
    "mosaicml-streaming": ("mosaic", "MDS, torchvision decode"),
    "NVIDIA DALI": ("dali", "CPU only: decoders.image_random_crop decodes only the crop's region"),
}


class StepModel(torch.nn.Module):
    """The end-to-end run's model (`model._target_=peers.StepModel`), too small to matter: it reads every 9th pixel
    of each row and column through 8 channels, so its step is 5-7 % of a 2-core budget at the pipeline's pace (the
    bench prints the share) and the run measures the loop around it, not the model."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, num_classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images[:, :, ::9, ::9])


def step_seconds(steps: int = 20) -> float:
    """Median CPU seconds of StepModel's training step (forward, backward, SGD) on a float batch of 224 px images,
    on one thread: what it takes out of the budget (CPU time, so a busy machine's waits for a core do not count)."""
    model, images = StepModel(15), torch.randn(BATCH, 3, SIZE, SIZE).contiguous(memory_format=torch.channels_last)
    optimizer, targets = torch.optim.SGD(model.parameters(), lr=0.1), torch.zeros(BATCH, dtype=torch.long)
    times = []
    with one_torch_thread():
        for _ in range(steps + 3):
            start = time.process_time()
            loss = torch.nn.functional.cross_entropy(model(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            times.append(time.process_time() - start)
    return sorted(times[3:])[steps // 2]


def pipeline_rate() -> float:
    """loadout's training stream alone, iterated as the peers are (bench/real_photos.py's way)."""
    with pipeline(*KIT, root=REAL_DATA) as data:
        batches = iter(host_batches(data))
        for _batch in first_epoch(data, batches):  # the warm-up epoch
            pass
        return epoch_rate(batch.images for batch in batches)  # the next epoch of the same stream


def outcome(command: list[str], env: dict | None = None) -> tuple[str, str | None]:
    """`command`'s stdout, and None when it succeeded, else why not in one line (the last it printed)."""
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return done.stdout, (f"exited {done.returncode}: {lines[-1] if lines else 'no output'}" if done.returncode
                         else None)


def printed(command: list[str]) -> dict:
    """The JSON line a row's process prints last, or {"error": why it printed none}."""
    stdout, error = outcome(command)
    return {"error": error} if error else json.loads(stdout.splitlines()[-1])


def end_to_end(tmp: Path) -> dict:
    """`python -m train ... augment=imagenet` with StepModel, as a user runs it; epoch 2's images_per_s from its
    metrics.jsonl (the epoch's whole wall time, first batch included, as epoch_rate counts the other rows')."""
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    path = os.pathsep.join(filter(None, (str(ROOT / "bench"), os.environ.get("PYTHONPATH"))))  # for StepModel
    env = {**os.environ, "PYTHONPATH": path}
    _, error = outcome([sys.executable, "-m", "train", "hardware=cpu", f"data.root={REAL_DATA}", *KIT,
                        "model._target_=peers.StepModel", "~model.name", f"hydra.run.dir={run_dir}"], env)
    if error:
        return {"error": error}
    epochs = [row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "epoch_s" in row]
    return {"images_per_s": epochs[-1]["images_per_s"]}


def peer_command(peer: str, *extra: str) -> list[str]:
    return [str(PEERS_PYTHON), str(ROOT / "bench" / "peer_loaders.py"), peer, "--photos", str(REAL_DATA),
            "--cache", str(CACHE), *extra]


def prepared() -> dict[str, dict]:
    """Each peer's converted copy written (untimed), its version; or why it cannot run."""
    rows = {}
    for row, (peer, _) in PEERS.items():
        if not PEERS_PYTHON.exists():
            rows[row] = {"error": f"no {PEERS_PYTHON}: `make bench-peers` makes the peers' venv"}
        else:
            rows[row] = printed(peer_command(peer, "--prepare"))
    return rows


def label(row: str, info: dict) -> str:
    if row in (E2E, PIPELINE):
        return f"**{row}**"
    _, usage = PEERS[row]
    return f"{row} {info.get('version', '')} ({usage})".replace("  ", " ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", action="store_true", help="only print loadout's pipeline's figure (a row)")
    if parser.parse_args().pipeline:
        return print(json.dumps({"images_per_s": pipeline_rate()}), flush=True)
    files = photo_files(REAL_DATA)
    print(f"{len(files)} photos in {REAL_DATA}; RandomResizedCrop {SIZE} + flip, uint8 batches of {BATCH}, "
          f"{WORKERS} workers or threads, epoch {EPOCHS} of {EPOCHS} timed, best of {ROUNDS} interleaved rounds; "
          f"{machine()}", flush=True)
    info = prepared()
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        sides = {E2E: lambda: end_to_end(Path(tmp)),
                 PIPELINE: lambda: printed([sys.executable, __file__, "--pipeline"]),
                 **{row: (lambda peer=peer: printed(peer_command(peer))) for row, (peer, _) in PEERS.items()
                    if "error" not in info[row]}}
        rates: dict[str, list[float]] = {row: [] for row in sides}
        for index in range(ROUNDS):
            for row in list(sides) if index % 2 == 0 else list(sides)[::-1]:
                result = sides[row]()
                if "error" in result:
                    info.setdefault(row, {})["error"] = result["error"]
                else:
                    rates[row].append(result["images_per_s"])
            print(f"  round {index + 1}: " + ", ".join(f"{row} {values[-1]:.0f}" for row, values in rates.items()
                                                       if len(values) > index), flush=True)
    best = {row: max(values) for row, values in rates.items() if values}
    print("| loader | img/s (best) | median | rounds |\n|---|---|---|---|")
    for row in (E2E, PIPELINE, *PEERS):
        figure = (f"{best[row]:.0f} | {statistics.median(rates[row]):.0f} | {spread(rates[row])}" if row in best
                  else f"did not run | | {info.get(row, {}).get('error', 'no figure')}")
        print(f"| {label(row, info.get(row, {}))} | {figure} |")
    median = {row: statistics.median(values) for row, values in rates.items() if values}
    step = step_seconds()
    comparisons = [(E2E, "loadout's pipeline alone", PIPELINE, PIPELINE, 0.9)]
    peers = [row for row in PEERS if row in best]
    if peers:  # the best peer by each figure: on a loaded box one quiet moment can crown a row by its best alone
        top, top_median = max(peers, key=best.get), max(peers, key=median.get)
        name = f"the best peer ({top}; by medians {top_median})"
        comparisons += [(E2E, name, top, top_median, 1.0), (PIPELINE, name, top, top_median, 1.15)]
    for row, name, other, other_median, target in comparisons:
        if row in best and other in best:
            ratio = best[row] / best[other]
            report(f"{row} / {name}", ratio, f">= {target:g}", ratio >= target,
                   f"{best[row]:.0f} vs {best[other]:.0f} img/s, best of {ROUNDS}; by medians "
                   f"{median[row] / median[other_median]:.2f}")
    if PIPELINE in best:
        budget = len(os.sched_getaffinity(0)) * BATCH / best[PIPELINE]
        print(f"  StepModel's step: {step * 1e3:.1f} ms of CPU a batch (fp32, one thread, median of 20), "
              f"{step / budget:.1%} of the budget (the usable cores x a batch's time at the pipeline's pace); "
              f"{machine()}", flush=True)


if __name__ == "__main__":
    main()
