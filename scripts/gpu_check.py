#!/usr/bin/env python3
"""`make gpu-check` (after the CUDA tests): is this GPU box set up right, and does the loader keep up?

Prints the GPU, driver and torch; runs one short epoch of each GPU profile on one GPU (rtx3060, rtx4080, a100), the
a100 profile with torch.compile, and a 1-process torchrun (nccl); then bench/gpu_prefetch.py. Each run's img/s and
data-wait fraction come from its metrics.jsonl. Writes outputs/gpu-check/report.json and report.png and prints a
table; exits 1 when there is no CUDA device or a run failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "gpu-check"
DATA = os.environ.get("DATA", str(ROOT / "data" / "synthetic"))
RUNS = {
    "rtx3060": ["hardware=rtx3060"],
    "rtx4080": ["hardware=rtx4080"],
    "a100": ["hardware=a100"],
    "a100 + compile": ["hardware=a100", "trainer.compile=true"],
}


def facts() -> dict:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()
    return {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "driver": driver or "unknown",
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}


def train(name: str, overrides: list[str], launcher: list[str]) -> dict:
    run_dir = OUT / name.replace(" ", "_").replace("+", "")
    args = [*launcher, "-m", "train", *overrides, f"data.root={DATA}", "trainer.epochs=1", "trainer.progress=false",
            "dataset=imagefolder", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    row = {"run": name, "ok": done.returncode == 0}
    metrics = run_dir / "metrics.jsonl"
    if done.returncode == 0 and metrics.is_file():
        last = json.loads(metrics.read_text().splitlines()[-1])
        row.update(images_per_s=last["images_per_s"], data_wait_frac=last["data_wait_frac"])
    else:
        row["error"] = (done.stderr or done.stdout).strip().splitlines()[-1:]
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "images_per_s" in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["run"] for r in ok], [r["images_per_s"] for r in ok])
    for i, r in enumerate(ok):
        ax.text(r["images_per_s"], i, f" data_wait {100 * r['data_wait_frac']:.1f}%", va="center")
    ax.set_xlabel("images/s (one epoch)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}): "
              "nothing to check. Is the NVIDIA driver installed, and the container started with GPUs?")
        return 1
    OUT.mkdir(parents=True, exist_ok=True)
    report = {"facts": facts(), "runs": []}
    print("  ".join(f"{k}: {v}" for k, v in report["facts"].items()))
    python = [sys.executable]
    for name, overrides in RUNS.items():
        report["runs"].append(train(name, overrides, python))
    report["runs"].append(train("torchrun nccl, 1 process", ["hardware=a100"],
                                [*python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]))
    bench = subprocess.run([*python, "bench/gpu_prefetch.py"], cwd=ROOT, capture_output=True, text=True)
    report["gpu_prefetch"] = bench.stdout.strip().splitlines()
    (OUT / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report["runs"], OUT / "report.png")
    print(f"{'run':<28}{'ok':<5}{'img/s':>9}{'data_wait':>11}")
    for row in report["runs"]:
        rate = f"{row['images_per_s']:.0f}" if "images_per_s" in row else "-"
        wait = f"{100 * row['data_wait_frac']:.1f}%" if "data_wait_frac" in row else " ".join(row.get("error", []))
        print(f"{row['run']:<28}{'yes' if row['ok'] else 'NO':<5}{rate:>9}{wait:>11}")
    print("\n".join(report["gpu_prefetch"]))
    print(f"report: {OUT / 'report.json'}, {OUT / 'report.png'}")
    return 0 if all(row["ok"] for row in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
