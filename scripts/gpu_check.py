#!/usr/bin/env python3
"""Is this GPU box set up right, and does the loader keep up? `make gpu-check`, or on a box whose torch is already
installed (an NGC container, a cluster module, no network): `python3 scripts/gpu_check.py` from the checkout, with
that interpreter.

In order, each part with a time limit and each failure named in the summary:
1. the packages loadout needs import (one line naming any missing), torch >= 2.6 and torchvision >= 0.21;
2. CUDA is usable (else one line with the likely cause: no driver, a driver older than torch's CUDA build, ...);
3. the CUDA tests (`pytest -m cuda`);
4. each GPU profile (rtx3060, rtx4080, a100, a100 + torch.compile, a100 + data.decode=device) trains several
   epochs on one GPU: the first epoch (worker start-up, cuDNN autotuning, compilation) is reported as warm-up, the
   rest as the figures;
5. NCCL: two processes under torchrun when there are two GPUs; with one, a one-process group forced through
   init_process_group("nccl") that all-reduces and trains a DDP step;
6. bench/gpu_prefetch.py.
Writes outputs/gpu-check/report.json (and report.png with matplotlib); exits 1 when any part failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # loadout importable from the checkout, whatever the interpreter
OUT = ROOT / "outputs" / "gpu-check"
DATA = os.environ.get("DATA", str(ROOT / "data" / "synthetic"))
SEED_DATA = ROOT / "data" / "synthetic-320"  # bench/gpu_prefetch.py's set
EPOCHS = 4  # the first is warm-up; the figures are the median of the rest
MIN_TORCH, MIN_TORCHVISION = (2, 6), (0, 21)  # the tested range (requirements.txt)
RUNS = {
    "rtx3060": ["hardware=rtx3060"],
    "rtx4080": ["hardware=rtx4080"],
    "a100": ["hardware=a100"],
    "a100 + compile": ["hardware=a100", "trainer.compile=true"],
    "a100 + decode on the GPU": ["hardware=a100", "data.decode=device"],
}
TIMEOUTS = {"dataset": 900, "cuda tests": 900, "run": 900, "nccl": 600, "gpu_prefetch": 900}
# import name -> the package to install
REQUIRED = {"torch": "torch", "torchvision": "torchvision", "hydra": "hydra-core", "omegaconf": "omegaconf",
            "torchdata": "torchdata", "simplejpeg": "simplejpeg", "PIL": "pillow", "numpy": "numpy",
            "psutil": "psutil", "tqdm": "tqdm", "tensorboard": "tensorboard", "prometheus_client": "prometheus-client",
            "pytest": "pytest"}
OPTIONAL = {"pynvml": "nvidia-ml-py (GPU utilisation)", "matplotlib": "matplotlib (report.png)"}


def missing_packages() -> list[str]:
    return [package for module, package in REQUIRED.items() if importlib.util.find_spec(module) is None]


def version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def environment_problem() -> str | None:
    """One line when this interpreter cannot run loadout: missing packages, or torch / torchvision too old."""
    missing = missing_packages()
    if missing:
        return (f"missing packages for {sys.executable}: {' '.join(missing)}; install them (no network: `pip download "
                f"{' '.join(missing)}` on a connected machine, then `pip install --no-index --find-links <dir> ...`)")
    import torch
    import torchvision

    if version_tuple(torch.__version__) < MIN_TORCH or version_tuple(torchvision.__version__) < MIN_TORCHVISION:
        return (f"torch {torch.__version__} / torchvision {torchvision.__version__}: loadout needs torch >= "
                f"{'.'.join(map(str, MIN_TORCH))} and torchvision >= {'.'.join(map(str, MIN_TORCHVISION))}")
    return None


def facts() -> dict:
    import torch

    from train.device import describe, driver_version

    return {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "driver": driver_version(),
            "torch": torch.__version__, "torchvision": importlib.import_module("torchvision").__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "python": sys.version.split()[0],
            "device": describe(torch.device("cuda", 0)),
            "optional_missing": [name for module, name in OPTIONAL.items() if importlib.util.find_spec(module) is None]}


def run(args: list[str], timeout: float, **kwargs) -> tuple[bool, str]:
    """A subprocess with loadout on PYTHONPATH: (succeeded, its last output line or why it failed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, **kwargs)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    lines = (done.stderr if done.returncode else done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
    return done.returncode == 0, lines[-1]


def ensure_dataset(root: Path, *args: str) -> tuple[bool, str]:
    if (root / ".complete").exists():
        return True, f"{root} present"
    return run([sys.executable, "scripts/make_dataset.py", "--out", str(root), *args], TIMEOUTS["dataset"])


def run_dir_for(name: str) -> Path:
    """A part's run dir: letters, digits and underscores only (a comma in hydra.run.dir reads as a sweep)."""
    return OUT / re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def train(name: str, overrides: list[str], launcher: list[str], epochs: int = EPOCHS) -> dict:
    """`epochs` epochs of one profile; the first is warm-up, the figures are the median of the others."""
    run_dir = run_dir_for(name)
    ok, line = run([*launcher, "-m", "train", *overrides, "dataset=imagefolder", f"data.root={DATA}",
                    f"trainer.epochs={epochs}", "trainer.progress=false", f"hydra.run.dir={run_dir}"],
                   TIMEOUTS["run"])
    row = {"part": name, "ok": ok}
    metrics = run_dir / "metrics.jsonl"
    if not (ok and metrics.is_file()):
        return {**row, "ok": False, "error": line}
    records = [json.loads(text) for text in metrics.read_text().splitlines()]
    warm = records[1:] or records
    row.update(images_per_s=statistics.median(r["images_per_s"] for r in warm),
               data_wait_frac=statistics.median(r["data_wait_frac"] for r in warm),
               warmup_epoch_s=records[0]["epoch_s"], first_batch_s=records[0]["first_batch_s"],
               measured_images=sum(r["images"] for r in warm), gpu_peak_mb=warm[-1].get("gpu_peak_mb"),
               gpu_util=warm[-1].get("gpu_util"))
    return row


def nccl_probe() -> int:
    """Under torchrun: an NCCL group (whatever its size), an all-reduce checked, and one DDP training step."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    total = torch.ones(1, device=device) * (rank + 1)
    dist.all_reduce(total)
    expected = world * (world + 1) / 2
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 8).to(device), device_ids=[device])
    model(torch.randn(32, 64, device=device)).square().mean().backward()
    torch.cuda.synchronize(device)
    backend = dist.get_backend()
    dist.destroy_process_group()
    if backend != "nccl" or total.item() != expected:
        print(f"nccl probe: backend {backend}, all-reduce {total.item()} (expected {expected})", file=sys.stderr)
        return 1
    print(f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))}: {world} process(es), all-reduce and a DDP step ok")
    return 0


def nccl(gpus: int) -> dict:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if gpus >= 2:
        return {**train("nccl, 2 processes", ["hardware=a100"], [*torchrun, "--nproc_per_node=2"], epochs=2),
                "part": "nccl, 2 processes"}
    ok, line = run([*torchrun, "--nproc_per_node=1", "scripts/gpu_check.py", "--nccl-probe"], TIMEOUTS["nccl"])
    return {"part": "nccl, 1 process (forced group)", "ok": ok, "detail" if ok else "error": line}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "images_per_s" in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["part"] for r in ok], [r["images_per_s"] for r in ok])
    for i, r in enumerate(ok):
        ax.text(r["images_per_s"], i, f" data_wait {100 * r['data_wait_frac']:.1f}%", va="center")
    ax.set_xlabel(f"images/s (median of epochs 2-{EPOCHS})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(rows: list[dict]) -> None:
    print(f"{'part':<32}{'ok':<5}{'img/s':>9}{'data_wait':>11}{'warm-up':>10}  detail")
    for row in rows:
        rate = f"{row['images_per_s']:.0f}" if "images_per_s" in row else "-"
        wait = f"{100 * row['data_wait_frac']:.1f}%" if "data_wait_frac" in row else "-"
        warm = f"{row['warmup_epoch_s']:.1f}s" if "warmup_epoch_s" in row else "-"
        print(f"{row['part']:<32}{'yes' if row['ok'] else 'NO':<5}{rate:>9}{wait:>11}{warm:>10}  "
              f"{row.get('error') or row.get('detail', '')}")


def main() -> int:
    problem = environment_problem()
    if problem:
        print(f"gpu-check: {problem}", file=sys.stderr)
        return 2
    import torch

    from train.device import CudaFacts, why_no_cuda

    if not torch.cuda.is_available():
        print(f"gpu-check: CUDA is unusable here: {why_no_cuda(CudaFacts.of_this_machine())}", file=sys.stderr)
        return 1
    OUT.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "facts": facts(), "parts": []}
    print("  ".join(f"{k}: {v}" for k, v in report["facts"].items() if k != "device"))
    rows = report["parts"]
    for root, args in ((Path(DATA), ()), (SEED_DATA, ("--size", "320", "--train-per-class", "60",
                                                      "--val-per-class", "5"))):
        ok, line = ensure_dataset(root, *args)
        if not ok:
            rows.append({"part": f"dataset {root.name}", "ok": False, "error": line})
    ok, line = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests"],
                   TIMEOUTS["cuda tests"])
    rows.append({"part": "cuda tests", "ok": ok, "detail" if ok else "error": line})
    for name, overrides in RUNS.items():
        rows.append(train(name, overrides, [sys.executable]))
        print(f"{name}: {'ok' if rows[-1]['ok'] else rows[-1]['error']}", flush=True)
    rows.append(nccl(torch.cuda.device_count()))
    ok, line = run([sys.executable, "bench/gpu_prefetch.py"], TIMEOUTS["gpu_prefetch"])
    rows.append({"part": "bench/gpu_prefetch.py", "ok": ok, "detail" if ok else "error": line})
    (OUT / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if importlib.util.find_spec("matplotlib") is not None:
        plot(rows, OUT / "report.png")
    print_table(rows)
    failed = [row["part"] for row in rows if not row["ok"]]
    print(f"report: {OUT / 'report.json'}")
    if failed:
        print(f"gpu-check: FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    print("gpu-check: every part passed")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nccl-probe", action="store_true", help="(under torchrun) the NCCL probe alone")
    sys.exit(nccl_probe() if parser.parse_args().nccl_probe else main())
