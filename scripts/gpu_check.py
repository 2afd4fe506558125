#!/usr/bin/env python3
"""Is this GPU box set up right, do loadout's GPU paths run, and does the loader keep up? `make gpu-check`, or on a
box whose torch came preinstalled (an NGC container, a cluster module, a lent machine with no network):
`python3 scripts/gpu_check.py` from the checkout, with that interpreter (docs/gpu.md).

First the environment, each problem in one line: the wheels of .gpu-wheels/ (`make gpu-wheels`) installed with no
index where loadout's packages are missing; every required module imported for real (a shared library missing is
named); torch >= 2.6 and torchvision >= 0.21; torchcodec loadable for the decode part; CUDA usable where an NVIDIA
driver answers (a GPU box whose CUDA is broken stops the check: a driver too old for torch, CUDA_VISIBLE_DEVICES
hiding the GPUs).
Then the parts (`--list`; choose with `--only` / `--skip`; `--plan short` for a 15-minute loan), each fitting one
10-minute command: a command past the part's limit is stopped with its whole process group (torchrun's ranks too).
`--deadline-s N` ends the check within N s: a part whose estimate does not fit is not run, a running one is cut. On a
machine with no NVIDIA driver the CUDA parts are skipped, one line each. Each training part trains in a fresh run
dir; the first epoch (worker start-up, cuDNN autotuning, compilation) is the warm-up, the figures are the median of the
others.
`report.json` is rewritten after every part (and written, minimal, when the environment stops the check), with
`report.png` at the end where matplotlib imports. Exit status: 0 no part failed (CUDA parts skipped on a machine with
no driver included), 1 a part failed, 2 the environment (CUDA unusable where a driver answers included), 3 none
failed but the deadline left parts out or cut one.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # loadout importable from the checkout, whatever the interpreter
if TYPE_CHECKING:  # imported for real once the environment is checked (loadout.device imports torch)
    from loadout.device import CudaFacts
MIN_TORCH, MIN_TORCHVISION = (2, 6), (0, 21)  # the tested range (requirements.txt)
MIN_TORCH_DECODE = (2, 11)  # torchcodec's stable-ABI builds (data.decode=device)
PART_S = 540  # each part's limit, all its commands together: one part fits one 10-minute command
TERM_S = 30  # a command past its limit: SIGTERM to its process group, this long to stop, then SIGKILL
CUT_S = 10  # --deadline-s: a running command gets SIGTERM this long before the deadline, SIGKILL at it
EPOCHS = 4  # the profile rows: the first is warm-up, the figures are the median of the rest
PATH_EPOCHS = 2  # the rows that check a path (DDP, resume, fp16, MixUp, deterministic): warm-up + one
# The profile rows' set: 320 px JPEGs (ImageNet's size class: decode costs what it costs there), cropped to 224,
# enough of them for >= 50 measured a100 steps (23 a 128-image epoch, 3 epochs measured) and for each of 12 workers
# to make several batches an epoch. bench/gpu_prefetch.py's own set (SEED_DATA) is made beside it.
PROFILE_SET = ("gpu-check-320", ("--size", "320", "--train-per-class", "300", "--val-per-class", "10"))
SEED_SET = ("synthetic-320", ("--size", "320", "--train-per-class", "60", "--val-per-class", "5"))
# import name -> distribution: what this script, `python -m train` and `pytest -m cuda tests` import
REQUIRED = {"torch": "torch", "torchvision": "torchvision", "hydra": "hydra-core", "omegaconf": "omegaconf",
            "torchdata": "torchdata", "simplejpeg": "simplejpeg", "PIL": "pillow", "numpy": "numpy",
            "psutil": "psutil", "tqdm": "tqdm", "tensorboard": "tensorboard", "prometheus_client": "prometheus-client",
            "pytest": "pytest", "yaml": "pyyaml", "fsspec": "fsspec", "pyarrow": "pyarrow", "zlib_ng": "zlib-ng"}
DECODE = {"torchcodec": "torchcodec"}  # the decode part alone: without it that part is skipped
OPTIONAL = {"pynvml": "nvidia-ml-py (GPU utilisation)", "matplotlib": "matplotlib (report.png)"}


@dataclass
class Check:
    """Where this run writes, and what the environment allows."""

    out: Path  # report.json, report.png
    runs: Path  # one run dir per training row, emptied before it
    data: Path  # the datasets' parent folder
    cuda_problem: str | None = None  # why the CUDA parts are skipped
    decode_problem: str | None = None  # why the decode part is skipped
    gpus: int = 0
    part_end: float = field(default_factory=lambda: time.monotonic() + PART_S)  # the running part's limit
    deadline: float = float("inf")  # --deadline-s: nothing runs past it (time.monotonic())
    short: bool = False  # --plan short: the parts' short sizes

    def left(self) -> float:
        """Seconds the next command may run: to the part's limit, or to CUT_S before the deadline (<= 0: none)."""
        return min(self.part_end, self.deadline - CUT_S) - time.monotonic()


@dataclass(frozen=True)
class Part:
    name: str
    about: str
    run: Callable[[Check], dict]
    estimate_s: int  # on an H200 with 16 cores, at the upper end (the dataset made apart): not a measurement
    short_s: int | None = None  # the same in the short plan, where it runs a smaller part
    cuda: bool = True

    def estimate(self, check: Check) -> int:
        return self.short_s if check.short and self.short_s else self.estimate_s


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def missing(modules: dict[str, str]) -> list[str]:
    return [dist for module, dist in modules.items() if importlib.util.find_spec(module) is None]


def install_wheels(folder: Path) -> str | None:
    """Install, with no index, the missing packages that `folder` (make gpu-wheels) carries, when it carries every
    missing required one. Returns one line saying what was installed, or why the install failed (then raises)."""
    absent = missing(REQUIRED) + missing(DECODE)
    carried = {canonical(wheel.name.split("-")[0]) for wheel in folder.glob("*.whl")}
    if not absent or not carried or any(canonical(dist) not in carried for dist in missing(REQUIRED)):
        return None
    names = [dist for dist in absent if canonical(dist) in carried]
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links",
                           str(folder), *names], capture_output=True, text=True)
    if done.returncode:
        raise EnvironmentProblem(f"pip install --no-index --find-links {folder} {' '.join(names)} failed: "
                                 f"{pip_error(done)}")
    importlib.invalidate_caches()
    return f"installed from {folder} (no index): {' '.join(names)}"


def pip_error(done: subprocess.CompletedProcess) -> str:
    """pip's first ERROR line (the cause; its last one is a link), else its last line."""
    lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
    return next((line for line in lines if line.startswith("ERROR: ")), lines[-1]).removeprefix("ERROR: ")


class EnvironmentProblem(Exception):
    """This interpreter cannot run loadout: one line naming what and the fix."""


def load_problem(module: str, err: BaseException) -> str:
    """One line for a module that is installed but does not import: the shared library it misses, if named."""
    text = str(err)
    library = re.search(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file", text)
    cause = f"{library.group(1)} is missing" if library else (text.strip().splitlines() or [type(err).__name__])[0]
    return f"{module} does not load ({cause[:300]})"


def check_environment() -> None:
    """Raise EnvironmentProblem when this interpreter cannot run loadout: packages missing or not loading (a shared
    library missing), torch / torchvision too old."""
    absent = missing(REQUIRED)
    if absent:
        raise EnvironmentProblem(
            f"missing packages for {sys.executable}: {' '.join(absent)}; install them (no network: `make gpu-wheels` "
            "on a connected machine, carry .gpu-wheels/ along, and this script installs them; torch and "
            "torchvision must be there already)")
    for module in REQUIRED:
        try:
            importlib.import_module(module)
        except Exception as err:  # a missing shared library is an OSError (or ImportError) at import
            raise EnvironmentProblem(f"{load_problem(module, err)}: install what it needs, or a build of "
                                     f"{REQUIRED[module]} for this machine") from err
    import torch
    import torchvision

    if version_tuple(torch.__version__) < MIN_TORCH or version_tuple(torchvision.__version__) < MIN_TORCHVISION:
        raise EnvironmentProblem(f"torch {torch.__version__} / torchvision {torchvision.__version__}: loadout needs "
                                 f"torch >= {'.'.join(map(str, MIN_TORCH))} and torchvision >= "
                                 f"{'.'.join(map(str, MIN_TORCHVISION))}")


def decode_problem() -> str | None:
    """None when torchcodec's image decoders load (nvJPEG; libcudart/libnvrtc of torch's CUDA major); else why
    data.decode=device cannot run, in one line. FFmpeg's libraries are not needed: torchcodec loads them only for
    video and audio."""
    import torch

    if missing(DECODE):
        return "torchcodec is not installed (pip install 'loadout[device-decode]'; make gpu-wheels carries it)"
    if version_tuple(torch.__version__) < MIN_TORCH_DECODE:
        return f"torchcodec needs torch >= {'.'.join(map(str, MIN_TORCH_DECODE))}; this is {torch.__version__}"
    try:
        importlib.import_module("torchcodec.decoders")
    except Exception as err:  # OSError or RuntimeError from torch.ops.load_library, not an ImportError
        return (f"{load_problem('torchcodec', err)}; it needs a torch built for CUDA 13 (its wheel's CUDA major), "
                f"this one is CUDA {torch.version.cuda}")
    return None


def gpu_present(cuda: CudaFacts) -> bool:
    """Whether an NVIDIA driver answers here (libcuda.so.1 loads, or NVML / nvidia-smi names a version). Where one
    does and CUDA is unusable anyway, the GPU box is broken and the check must fail; where none does, the machine
    has no GPU and skipping the CUDA parts is the right result."""
    return cuda.driver_cuda is not None or cuda.driver_version is not None


def facts() -> dict:
    import torch

    from loadout.device import describe, driver_version

    cuda = torch.cuda.is_available()
    shm = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").is_dir() else None
    codec = sys.modules.get("torchcodec")
    return {"gpu": torch.cuda.get_device_name(0) if cuda else None, "gpus": torch.cuda.device_count() if cuda else 0,
            "driver": driver_version(), "torch": torch.__version__,
            "torchvision": importlib.import_module("torchvision").__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None, "python": sys.version.split()[0],
            "cpus": os.cpu_count(), "shm_gb": round(shm / 1e9, 1) if shm else None,
            "torchcodec": getattr(codec, "__version__", None),
            "ffmpeg": getattr(codec, "ffmpeg_major_version", None),
            "device": describe(torch.device("cuda", 0)) if cuda else "cpu",
            "optional_missing": [name for module, name in OPTIONAL.items() if importlib.util.find_spec(module) is None]}


def run(check: Check, args: list[str], env: dict | None = None) -> tuple[bool, str]:
    """A subprocess with loadout on PYTHONPATH, within the part's limit: (succeeded, its last output line or why it
    failed). Raises PartCut when the deadline cuts it, or comes before it could start."""
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    timeout = check.left()
    if timeout <= 0:
        raise PartCut("the deadline came before its next command")
    # its own session: on a timeout the whole group goes, not the direct child alone (torchrun's ranks, workers)
    with subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc, min(TERM_S, max(check.deadline - time.monotonic(), 1)))
            if check.part_end > check.deadline - CUT_S:
                raise PartCut(f"cut at the deadline after {timeout:.0f} s") from None
            return False, f"timed out after {timeout:.0f} s"
    lines = (err if proc.returncode else out).strip().splitlines() or [f"exit {proc.returncode}"]
    return proc.returncode == 0, lines[-1]


def stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the process group (torchrun stops its ranks, loadout saves a checkpoint), `grace` seconds to end,
    then SIGKILL to the group (it holds orphans too, whose parent ended first) and to every descendant seen at the
    timeout: torchrun starts each rank in a session of its own, which a group signal misses."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    signal_group(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):  # still running, or a rank in its own session holds the pipes
        proc.communicate(timeout=grace)
    signal_group(proc.pid, signal.SIGKILL)
    proc.kill()  # were it no longer its group's leader
    for child in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()  # psutil checks it is still the same process (its creation time), not a reused pid
    proc.wait()


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def ensure_dataset(check: Check, name: str, args: tuple[str, ...]) -> Path:
    root = check.data / name
    if not (root / ".complete").exists():
        ok, line = run(check, [sys.executable, "scripts/make_dataset.py", "--out", str(root), *args])
        if not ok:
            raise PartFailed(f"dataset {root}: {line}")
    return root


class PartFailed(Exception):
    """A part cannot go on: its row is a failure with this line."""


class PartCut(Exception):
    """--deadline-s stopped a part: its row says so, with this line, and is no failure of loadout."""


def run_dir_for(check: Check, name: str) -> Path:
    """A row's run dir: letters, digits and underscores only (a comma in hydra.run.dir reads as a sweep)."""
    return check.runs / re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def train(check: Check, name: str, overrides: list[str], *, epochs: int = EPOCHS, launcher: list[str] | None = None,
          root: Path | None = None, fresh: bool = True) -> dict:
    """One `python -m train` run of `epochs` epochs on the profile set, in a run dir emptied first (`fresh`): no
    earlier metrics.jsonl mixed in, no earlier no-retry note refusing the run. The row: its figures (warm-up epoch
    apart), with bad samples and device-decode fallbacks summed over every epoch."""
    root = root or ensure_dataset(check, *PROFILE_SET)
    run_dir = run_dir_for(check, name)
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    ok, line = run(check, [*(launcher or [sys.executable]), "-m", "train", *overrides, "dataset=imagefolder",
                           f"data.root={root}", f"trainer.epochs={epochs}", "trainer.progress=false",
                           f"hydra.run.dir={run_dir}"])
    metrics = run_dir / "metrics.jsonl"
    if not (ok and metrics.is_file()):
        raise PartFailed(line)
    records = [json.loads(text) for text in metrics.read_text().splitlines()]
    warm = records[1:] or records
    row = {"run_dir": str(run_dir), "epochs": len(records),
           "images_per_s": statistics.median(r["images_per_s"] for r in warm),
           "data_wait_frac": statistics.median(r["data_wait_frac"] for r in warm),
           "warmup_epoch_s": records[0]["epoch_s"], "first_batch_s": records[0]["first_batch_s"],
           "measured_images": sum(r["images"] for r in warm), "gpu_peak_mb": warm[-1].get("gpu_peak_mb"),
           "gpu_util": warm[-1].get("gpu_util"), "val_acc": records[-1].get("val_acc")}
    for key in ("bad_samples", "decode_fallbacks", "skipped_steps"):
        row[key] = sum(r.get(key) or 0 for r in records)
    if row["bad_samples"]:
        raise PartFailed(f"{row['bad_samples']} samples skipped as unreadable (run dir {run_dir})", row)
    return row


def run_log(run_dir: Path) -> str:
    """Rank 0's log of a run (Hydra names it after the job: __main__.log)."""
    return "".join(path.read_text(errors="replace") for path in run_dir.glob("*.log"))


def profile(name: str, *overrides: str) -> Callable[[Check], dict]:
    return lambda check: train(check, name, list(overrides))


def decode_on_device(check: Check) -> dict:
    """a100 with data.decode=device: fails when any file fell back to the CPU decoder (refused by nvJPEG). The short
    plan measures one epoch after the warm-up: every file still goes through nvJPEG."""
    row = train(check, "decode", ["hardware=a100", "data.decode=device"], epochs=PATH_EPOCHS if check.short else EPOCHS)
    if row["decode_fallbacks"]:
        raise PartFailed(f"{row['decode_fallbacks']} files fell back to the CPU decoder (nvJPEG refused them)", row)
    return row


def ddp(check: Check) -> dict:
    """loadout's own DDP path on NCCL through TrainStep, one rank per GPU (one on a one-GPU machine:
    trainer.ddp=always): gradient accumulation's no_sync, compile + DDP, the gloo control group, the metric
    all-reduces. The short plan leaves compile out: its cold Inductor compile under DDPOptimizer is most of the
    part's time (the compile part checks compile alone)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={max(check.gpus, 1)}"]
    compile_ = "false" if check.short else "true"
    row = train(check, "ddp", ["hardware=a100", "trainer.ddp=always", f"trainer.compile={compile_}",
                               "trainer.grad_accum_steps=2"], epochs=PATH_EPOCHS, launcher=torchrun)
    group = re.search(r"process group: (\w+), (\d+) process", run_log(Path(row["run_dir"])))
    if group is None or group.group(1) != "nccl":
        raise PartFailed(f"no NCCL process group in the run's log ({group.group(0) if group else 'none'})", row)
    return {**row, "backend": group.group(1), "processes": int(group.group(2))}


def resume(check: Check) -> dict:
    """AdamW for one epoch, then trainer.resume=auto in the same run dir for a second, on CUDA."""
    overrides = ["hardware=a100", "optimizer=adamw"]
    train(check, "resume", overrides, epochs=1)
    row = train(check, "resume", [*overrides, "trainer.resume=auto"], epochs=2, fresh=False)
    if row["epochs"] != 2 or "resumed from" not in run_log(Path(row["run_dir"])):
        raise PartFailed(f"the second run did not resume ({row['epochs']} epochs in metrics.jsonl)", row)
    return row


def path_row(name: str, *overrides: str) -> Callable[[Check], dict]:
    return lambda check: train(check, name, ["hardware=a100", *overrides], epochs=PATH_EPOCHS)


def datasets(check: Check) -> dict:
    root = ensure_dataset(check, *PROFILE_SET)
    return {"detail": f"{root}: {sum(1 for _ in (root / 'train').rglob('*.jpg'))} training images"}


def cuda_tests(check: Check) -> dict:
    ok, line = run(check, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests"])
    if not ok:
        raise PartFailed(line)
    return {"detail": line}


def prefetch_bench(check: Check) -> dict:
    root = ensure_dataset(check, *SEED_SET)
    ok, line = run(check, [sys.executable, "bench/gpu_prefetch.py"], env={"SEED_DATA": str(root)})
    if not ok:
        raise PartFailed(line)
    return {"detail": line}


PARTS = [  # estimates (s): the review's (docs/gpu.md), for the deadline's choice of what still fits
    Part("datasets", "make the profile set: 3,000 JPEGs of 320 px (the training parts make it too when missing)",
         datasets, 45, cuda=False),
    Part("cuda-tests", "pytest -m cuda: prefetcher, no host sync, fp16 scaler, real OOM halving, ...", cuda_tests, 120),
    Part("rtx3060", "hardware=rtx3060 (ResNet-18, 3 workers), 4 epochs", profile("rtx3060", "hardware=rtx3060"), 75),
    Part("rtx4080", "hardware=rtx4080, 4 epochs", profile("rtx4080", "hardware=rtx4080"), 75),
    Part("a100", "hardware=a100 (ResNet-50, 12 workers, bf16), 4 epochs: img/s, data wait",
         profile("a100", "hardware=a100"), 75),
    Part("compile", "a100 + trainer.compile=true (Inductor: train and eval graphs)",
         profile("compile", "hardware=a100", "trainer.compile=true"), 240),
    Part("decode", "a100 + data.decode=device (torchcodec, nvJPEG); fails on any CPU fallback; short plan: 2 epochs",
         decode_on_device, 75, 60),
    Part("ddp", "torchrun, one rank per GPU, trainer.ddp=always on NCCL, compile + grad_accum_steps=2; short plan: "
         "no compile", ddp, 300, 90),
    Part("resume", "AdamW one epoch, then trainer.resume=auto on CUDA", resume, 105),
    Part("fp16-clip", "trainer.precision=fp16 (GradScaler) + trainer.grad_clip=1.0",
         path_row("fp16-clip", "trainer.precision=fp16", "trainer.grad_clip=1.0"), 60),
    Part("mixup", "augment=strong (MixUp/CutMix on the GPU)", path_row("mixup", "augment=strong"), 60),
    Part("deterministic", "trainer.deterministic=true (cuBLAS workspace, deterministic kernels)",
         path_row("deterministic", "trainer.deterministic=true"), 60),
    Part("prefetch-bench", "bench/gpu_prefetch.py: h2d copy, data wait with and without the prefetcher",
         prefetch_bench, 120),
]
PART_NAMES = [part.name for part in PARTS]
# --plan short, for one 15-minute loan (docs/gpu.md): in the order of what the parts prove, the default GPU path
# first; ddp last, where a kill at its limit disturbs nothing else. The set is made first, so that its time is
# counted where the deadline can see it.
SHORT_PLAN = ["datasets", "a100", "decode", "resume", "ddp"]


def part_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PART_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"no part {', '.join(unknown)}: choose from {', '.join(PART_NAMES)}")
    return names


def chosen(only: list[str] | None, skip: list[str], short: bool = False) -> list[Part]:
    order = [next(part for part in PARTS if part.name == name) for name in SHORT_PLAN] if short else PARTS
    return [part for part in order if (not only or part.name in only) and part.name not in skip]


def run_part(check: Check, part: Part) -> dict:
    """One part, as a report row: status passed, failed (with the error) or skipped (with the reason)."""
    if part.cuda and check.cuda_problem:
        return {"part": part.name, "status": "skipped", "reason": "needs CUDA, unusable here (see notes)"}
    if part.name == "decode" and check.decode_problem:
        return {"part": part.name, "status": "skipped", "reason": check.decode_problem}
    started = time.monotonic()
    if started + part.estimate(check) > check.deadline - CUT_S:  # it would be cut: leave the time to the report
        return {"part": part.name, "status": "not run", "reason": f"would not end before the deadline (about "
                f"{part.estimate(check)} s, {max(check.deadline - started, 0):.0f} s left)"}
    check.part_end = started + PART_S
    try:
        row = {"part": part.name, "status": "passed", **part.run(check)}
    except PartFailed as failed:
        figures = failed.args[1] if len(failed.args) > 1 else {}
        row = {"part": part.name, "status": "failed", "error": failed.args[0], **figures}
    except PartCut as cut:
        row = {"part": part.name, "status": "cut", "reason": cut.args[0]}
    return {**row, "seconds": round(time.monotonic() - started, 1)}


def one_line(row: dict) -> str:
    if row["status"] == "skipped":
        return f"gpu-check: skip {row['part']}: {row['reason']}"
    if row["status"] in ("not run", "cut"):
        return f"gpu-check: {row['part']} {row['status']}: {row['reason']}"
    if row["status"] == "failed":
        return f"gpu-check: {row['part']} FAILED: {row['error']}"
    figures = (f"{row['images_per_s']:.0f} img/s, data_wait {100 * row['data_wait_frac']:.1f}%, warm-up "
               f"{row['warmup_epoch_s']:.1f} s" if "images_per_s" in row else row.get("detail", ""))
    return f"gpu-check: {row['part']} passed ({row['seconds']:.0f} s): {figures}"


def write_report(check: Check, report: dict) -> None:
    check.out.mkdir(parents=True, exist_ok=True)
    path = check.out / "report.json"
    path.with_suffix(".tmp").write_text(json.dumps(report, indent=2) + "\n")
    path.with_suffix(".tmp").replace(path)  # a run killed mid-write leaves the previous report whole


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "images_per_s" in r]
    if not ok:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["part"] for r in ok], [r["images_per_s"] for r in ok])
    for i, r in enumerate(ok):
        ax.text(r["images_per_s"], i, f" data_wait {100 * r['data_wait_frac']:.1f}%", va="center")
    ax.set_xlabel("images/s (median of the epochs after the warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_parts(check: Check, parts: list[Part], report: dict) -> None:
    """Each part in turn, report.json rewritten after each."""
    for part in parts:
        row = run_part(check, part)
        report["parts"].append(row)
        report["pending"].remove(part.name)
        write_report(check, report)
        print(one_line(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    if args.list:
        for part in PARTS:
            short = f", short plan ~{part.short_s} s" if part.short_s else ""
            print(f"{part.name:<15}{'(CUDA) ' if part.cuda else ''}{part.about} (~{part.estimate_s} s{short})")
        return 0
    check = Check(out=args.out, runs=args.runs, data=args.data, short=args.plan == "short",
                  deadline=started + (float("inf") if args.deadline_s is None else args.deadline_s))
    parts = chosen(args.only, args.skip, check.short)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": sys.argv, "python": sys.executable,
              "notes": [], "parts": [], "pending": [part.name for part in parts]}
    try:
        installed = install_wheels(args.wheels)
        if installed:
            print(f"gpu-check: {installed}", flush=True)
            report["notes"].append(installed)
        check_environment()
    except EnvironmentProblem as problem:
        report["error"] = str(problem)
        write_report(check, report)
        print(f"gpu-check: {problem}", file=sys.stderr)
        return 2
    import torch

    from loadout.device import CudaFacts, why_no_cuda

    check.decode_problem = decode_problem()
    broken = False  # CUDA unusable on a machine with an NVIDIA driver
    if torch.cuda.is_available():
        check.gpus = torch.cuda.device_count()
    else:
        cuda = CudaFacts.of_this_machine()
        check.cuda_problem = f"CUDA is unusable here: {why_no_cuda(cuda)}"
        broken = gpu_present(cuda) and any(part.cuda for part in parts)
    report["facts"] = facts()
    if broken:
        driver = cuda.driver_version or f"for CUDA {cuda.driver_cuda}"
        report["error"] = (f"{check.cuda_problem}; yet an NVIDIA driver answers here (driver {driver}): a GPU box "
                           "whose CUDA is broken, not one without GPUs, so the CUDA parts cannot run")
        write_report(check, report)
        print(f"gpu-check: {report['error']}", file=sys.stderr)
        return 2
    for note in filter(None, [check.cuda_problem and f"{check.cuda_problem}; the CUDA parts are skipped",
                              check.decode_problem and f"{check.decode_problem}: the decode part is skipped, the rest "
                              "runs"]):
        report["notes"].append(note)
        print(f"gpu-check: {note}", flush=True)
    print("  ".join(f"{k}: {v}" for k, v in report["facts"].items() if k not in ("device", "optional_missing")),
          flush=True)
    write_report(check, report)
    run_parts(check, parts, report)
    rows = report["parts"]
    if importlib.util.find_spec("matplotlib") is not None:
        plot(rows, check.out / "report.png")
    failed = [row["part"] for row in rows if row["status"] == "failed"]
    skipped = [row["part"] for row in rows if row["status"] == "skipped"]
    print(f"report: {check.out / 'report.json'}")
    left_out = [f"{row['part']} ({row['status']})" for row in rows if row["status"] in ("not run", "cut")]
    if failed:
        print(f"gpu-check: FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    if left_out:
        print(f"gpu-check: no part failed, but the deadline (--deadline-s {args.deadline_s:g}) left out: "
              f"{', '.join(left_out)}", file=sys.stderr)
        return 3
    print(f"gpu-check: no part failed ({len(rows) - len(skipped)} ran, {len(skipped)} skipped)")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=part_list, metavar="PART[,PART]", help="run these parts alone (--list)")
    parser.add_argument("--skip", type=part_list, metavar="PART[,PART]", action="extend", default=[],
                        help="leave these parts out")
    parser.add_argument("--list", action="store_true", help="list the parts, what each runs and its estimate")
    parser.add_argument("--plan", choices=["short"], help=f"short: {', '.join(SHORT_PLAN)} in that order, smaller "
                        "(one 15-minute loan; --only/--skip choose within it)")
    parser.add_argument("--deadline-s", type=float, metavar="N",
                        help="end within N s of the start: no part starts that its estimate says cannot end by then, "
                             "a running one is cut (report.json: not run / cut; exit 3)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu-check",
                        help="where report.json and report.png go ($OUT on a lent machine)")
    parser.add_argument("--runs", type=Path, default=ROOT / "outputs" / "gpu-check" / "runs",
                        help="the training parts' run dirs (each emptied before its part)")
    parser.add_argument("--data", type=Path, default=ROOT / "data", help="where the datasets are made")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".gpu-wheels",
                        help="wheels to install with no index where packages are missing (make gpu-wheels)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
