"""The GPU check's harness, here on the CPU: the wheel set for the offline GPU machine is complete (pip's resolver,
offline, for its Python and platform), scripts/gpu_check.py installs carried wheels with no index, skips each CUDA part
in one line, writes report.json before and after every part, trains each row in a fresh run dir, ends a command past
its limit with all its descendants, keeps to --deadline-s, and trainer.ddp=always wraps a single torchrun process in
DDP."""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from loadout.device import CudaFacts
from tests.conftest import ROOT, read_metrics, run_cli, wait_for
from tests.test_distributed import torchrun

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402

CUDA_PARTS = [part.name for part in gpu_check.PARTS if part.cuda]
CARRIED_PURE = ("hydra", "omegaconf", "antlr4", "torchdata")  # py3-none-any: installable here, on Python 3.11


def gpu_check_run(*args: str, python: str = sys.executable, timeout: float = 120,
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([python, "scripts/gpu_check.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def stand_in(folder: Path, name: str, version: str) -> None:
    """A metadata-only wheel: tells pip's resolver that the GPU machine has `name` `version` installed."""
    dist = re.sub(r"[-_.]+", "_", name).lower()
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: loadout-tests\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def resolve_offline(tmp_path: Path, *find_links: Path) -> subprocess.CompletedProcess:
    """pip's resolver, no index and no pip config of this machine, for the GPU machine's Python and platform, asked
    for every distribution gpu_check imports (the preinstalled ones at their versions there)."""
    pins = {**{dist: None for dist in [*gpu_check.REQUIRED.values(), *gpu_check.DECODE.values()]},
            **{entry.split(" ")[0]: None for entry in gpu_check.OPTIONAL.values()},
            **{name: version for name, version in gpu_wheels.PREINSTALLED.items() if version}}
    links = [arg for folder in find_links for arg in ("--find-links", str(folder))]
    return subprocess.run(
        [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed", "--no-index",
         *links, *gpu_wheels.TARGET, "--quiet", "--report", str(tmp_path / "resolved.json"),
         *[f"{name}=={version}" if version else name for name, version in pins.items()]],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})


@pytest.mark.slow
def test_the_wheel_set_resolves_offline_for_the_gpu_machine(tmp_path):
    """`make gpu-wheels` (network; a complete set is kept) + the machine's preinstalled packages = everything
    gpu_check, `python -m train` and `pytest -m cuda` import, for CPython 3.12 on manylinux_2_28_x86_64."""
    made = subprocess.run(["make", "--no-print-directory", "gpu-wheels"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert made.returncode == 0, made.stdout + made.stderr
    total = float(re.search(r"([\d.]+) MiB  in all", made.stdout).group(1))
    assert 0 < total < gpu_wheels.LIMIT_MIB, made.stdout
    preinstalled = tmp_path / "preinstalled"
    preinstalled.mkdir()
    for name, version in gpu_wheels.PREINSTALLED.items():
        stand_in(preinstalled, name, version or importlib.metadata.version(name))

    done = resolve_offline(tmp_path, gpu_wheels.WHEELS, preinstalled)
    assert done.returncode == 0, done.stderr
    resolved = {gpu_wheels.canonical(item["metadata"]["name"]): (item["metadata"]["version"],
                                                                 item["download_info"]["url"])
                for item in json.loads((tmp_path / "resolved.json").read_text())["install"]}
    carried = {gpu_wheels.wheel_name(wheel) for wheel in gpu_wheels.WHEELS.glob("*.whl")}
    assert carried == set(gpu_wheels.CARRIED)
    for name, (_, url) in resolved.items():  # nothing from anywhere else, every carried wheel used
        assert (name in carried and "/.gpu-wheels/" in url) or (name in gpu_wheels.PREINSTALLED
                                                                  and "/preinstalled/" in url), (name, url)
    assert carried <= set(resolved)
    assert resolved["torch"][0] == "2.11.0+cu130" and resolved["torchvision"][0] == "0.26.0"
    assert resolved["torchcodec"][0] == gpu_wheels.locked_versions()["torchcodec"]

    without = resolve_offline(tmp_path, preinstalled)  # the machine as it is: the resolver says what it lacks
    assert without.returncode != 0 and "hydra-core" in without.stderr, without.stderr


@pytest.mark.slow
def test_gpu_check_installs_carried_wheels_with_no_index_then_runs(tmp_path):
    """An interpreter with torch but without hydra-core, omegaconf, antlr4 and torchdata (a venv that sees this
    one's packages less those): gpu_check installs them from the wheel folder with no index, then goes on."""
    made = subprocess.run(["make", "--no-print-directory", "gpu-wheels"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert made.returncode == 0, made.stderr
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for wheel in gpu_wheels.WHEELS.glob("*-py3-none-any.whl"):
        (wheels / wheel.name).symlink_to(wheel)
    venv, shared = tmp_path / "venv", tmp_path / "shared"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)  # pip: shared
    site = Path(torch.__file__).parents[1]
    shared.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith(CARRIED_PURE) and not entry.name.endswith(".pth"):
            (shared / entry.name).symlink_to(entry)
    venv_site = next((venv / "lib").glob("python3*/site-packages"))
    (venv_site / "shared.pth").write_text(f"{shared}\n")
    python = str(venv / "bin" / "python")
    assert subprocess.run([python, "-c", "import torch, hydra"], capture_output=True).returncode != 0

    done = gpu_check_run("--wheels", str(wheels), "--only", "a100", "--out", str(tmp_path / "out"), python=python,
                         timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first == f"gpu-check: installed from {wheels} (no index): hydra-core omegaconf torchdata", first
    assert subprocess.run([python, "-c", "import hydra, omegaconf, antlr4, torchdata"]).returncode == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["notes"][0] == first.removeprefix("gpu-check: ")


def test_gpu_check_stops_in_one_line_with_a_minimal_report_when_the_environment_cannot_run_it(tmp_path):
    """The base Python here lacks torch: exit 2, one line naming what is missing, report.json with the error."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    if subprocess.run([str(base), "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"{base} has torch")
    done = gpu_check_run("--wheels", str(tmp_path / "no-wheels"), "--out", str(tmp_path), python=str(base))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("gpu-check: missing packages for"), lines
    assert " torch " in lines[0] and "hydra-core" in lines[0] and "make gpu-wheels" in lines[0], lines
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["error"] == lines[0].removeprefix("gpu-check: ") and report["parts"] == []
    assert report["pending"] == gpu_check.PART_NAMES


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is unusable")
def test_without_cuda_each_cuda_part_is_skipped_in_one_line_and_reported(tmp_path):
    if gpu_check.gpu_present(CudaFacts.of_this_machine()):
        pytest.skip("an NVIDIA driver answers here: unusable CUDA is a broken GPU box, exit 2")
    done = gpu_check_run("--skip", "datasets", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("gpu-check: CUDA is unusable here: ") and "the CUDA parts are skipped" in lines[0]
    skips = [line for line in lines if line.startswith("gpu-check: skip ")]
    assert skips == [f"gpu-check: skip {name}: needs CUDA, unusable here (see notes)" for name in CUDA_PARTS]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(row["part"], row["status"]) for row in report["parts"]] == [(name, "skipped") for name in CUDA_PARTS]
    assert report["pending"] == [] and report["facts"]["gpus"] == 0 and report["notes"][0] in lines[0]

    done = gpu_check_run("--only", "decode,a100", "--skip", "decode", "--out", str(tmp_path))
    report = json.loads((tmp_path / "report.json").read_text())  # a run's own report: no earlier rows kept
    assert done.returncode == 0 and [row["part"] for row in report["parts"]] == ["a100"], done.stdout

    done = gpu_check_run("--only", "a100,nccl")
    assert done.returncode == 2 and "no part nccl: choose from datasets, cuda-tests" in done.stderr


@pytest.mark.parametrize(("facts", "present"), [
    (CudaFacts(None, None), False),  # a CPU machine with a CPU-only torch
    (CudaFacts("13.0", None), False),  # a CUDA torch on a machine with no driver (CI, a laptop)
    (CudaFacts("13.0", "-1"), False),  # ... whatever CUDA_VISIBLE_DEVICES says
    (CudaFacts(None, None, "13.0", "580.95.05", 0), True),  # a CPU-only torch on a GPU box
    (CudaFacts("13.0", "", "13.0", "580.95.05", 100), True),  # CUDA_VISIBLE_DEVICES hides the GPU
    (CudaFacts("13.0", "7", "13.0", "580.95.05", 100), True),  # ... or names one that is not there
    (CudaFacts("13.0", None, "12.4", "550.54.15", 35), True),  # the driver is too old for torch
    (CudaFacts("13.0", None, None, "550.54.15"), True),  # nvidia-smi answers, libcuda.so.1 does not load
])
def test_unusable_cuda_is_a_failure_where_an_nvidia_driver_answers(facts, present):
    assert gpu_check.gpu_present(facts) is present


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is unusable")
def test_a_gpu_box_whose_cuda_is_unusable_stops_the_check_in_one_line(tmp_path):
    """An nvidia-smi that answers with a driver version (a box with a driver whose libcuda does not load here): no
    part runs, exit 2, one line, report.json with the error; with no CUDA part chosen the check goes on."""
    if CudaFacts.of_this_machine().driver_cuda is not None:
        pytest.skip("libcuda.so.1 loads here")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 580.95.05\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    path = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = gpu_check_run("--only", "datasets,a100", "--out", str(tmp_path), env=path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stdout + done.stderr
    assert lines[0].startswith("gpu-check: CUDA is unusable here: no NVIDIA driver found"), lines
    assert "yet an NVIDIA driver answers here (driver 580.95.05): a GPU box whose CUDA is broken" in lines[0], lines
    assert "gpu-check: skip" not in done.stdout and "no part failed" not in done.stdout, done.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["error"] == lines[0].removeprefix("gpu-check: ") and report["parts"] == []
    assert report["pending"] == ["datasets", "a100"] and report["facts"]["driver"] == "580.95.05"

    done = gpu_check_run("--only", "datasets", "--skip", "datasets", "--out", str(tmp_path), env=path)
    assert done.returncode == 0 and "the CUDA parts are skipped" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow
def test_report_json_is_written_before_the_first_part_ends(tmp_path):
    """A command killed during a part (the lent machine's 10-minute limit) still leaves report.json: the facts,
    and the parts not finished."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "scripts/gpu_check.py", "--only", "datasets", "--out", str(out),
                             "--data", str(tmp_path / "data")], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: (out / "report.json").exists(), 60, "report.json before the datasets part ends")
        os.killpg(proc.pid, signal.SIGKILL)  # gpu_check and the dataset maker it started
    finally:
        proc.wait(timeout=30)
    report = json.loads((out / "report.json").read_text())
    assert report["parts"] == [] and report["pending"] == ["datasets"] and report["facts"]["torch"], report
    assert not (tmp_path / "data" / gpu_check.PROFILE_SET[0] / ".complete").exists()  # killed mid-part indeed


def test_the_profile_set_gives_the_a100_rows_50_measured_steps():
    per_class = int(gpu_check.PROFILE_SET[1][gpu_check.PROFILE_SET[1].index("--train-per-class") + 1])
    batch = yaml.safe_load((ROOT / "conf" / "hardware" / "a100.yaml").read_text())["data"]["batch_size"]
    steps_per_epoch = per_class * 10 // batch  # ten classes, drop_last
    assert steps_per_epoch * (gpu_check.EPOCHS - 1) >= 50
    assert steps_per_epoch >= 12  # each of the a100's 12 workers makes a batch or more an epoch


def test_a_library_that_does_not_load_is_named_in_one_line():
    with pytest.raises(OSError) as err:
        ctypes.CDLL("libloadout_absent.so.13")
    assert gpu_check.load_problem("torchcodec", err.value) == "torchcodec does not load (libloadout_absent.so.13 " \
                                                              "is missing)"


@pytest.mark.slow
def test_each_training_row_starts_from_a_fresh_run_dir(tiny_dataset, tmp_path):
    """The same row twice: the second reports its own epochs alone (no metrics.jsonl appended to); then plotted."""
    check = gpu_check.Check(out=tmp_path, runs=tmp_path / "runs", data=tmp_path)
    overrides = ["hardware=cpu", "data.image_size=32", "data.batch_size=64"]
    rows = [gpu_check.train(check, "cpu row", overrides, epochs=2, root=tiny_dataset) for _ in range(2)]
    for row in rows:
        assert row["epochs"] == 2 and row["measured_images"] == 192 and row["images_per_s"] > 0, row
        assert row["bad_samples"] == 0 and row["decode_fallbacks"] == 0, row
    assert len(read_metrics(Path(rows[1]["run_dir"]))) == 2
    gpu_check.plot([{"part": "cpu row", **rows[1]}], tmp_path / "report.png")
    assert (tmp_path / "report.png").stat().st_size > 0


def ddp_args(root: Path, run_dir: Path) -> list[str]:
    return ["hardware=cpu", f"data.root={root}", "data.image_size=32", "data.batch_size=16", "data.num_workers=1",
            "model.name=resnet18", "trainer.epochs=1", "trainer.grad_accum_steps=2", "trainer.progress=false",
            f"hydra.run.dir={run_dir}"]


@pytest.mark.slow
def test_ddp_always_wraps_a_single_torchrun_process_in_ddp(tiny_dataset, tmp_path):
    """gloo here (NCCL on a GPU): DDP's gradient all-reduce runs once per optimizer step, after the micro-step that
    no_sync leaves local; with auto, one torchrun process trains with no process group."""
    probe = tmp_path / "probe"
    probe.mkdir()
    done = torchrun([*ddp_args(tiny_dataset, tmp_path / "always"), "trainer.ddp=always"], ROOT, nproc=1,
                    entry=("tests/ddp_probe.py",), env={"PROBE_DIR": str(probe)})
    assert done.returncode == 0, done.stderr[-3000:]
    events = Counter(json.loads((probe / "rank0.json").read_text()))
    steps = events["step: identical"]
    assert steps > 0 and events["forward"] == 2 * steps and events["allreduce"] >= steps, events
    log = "".join(path.read_text() for path in (tmp_path / "always").glob("*.log"))
    assert "process group: gloo, 1 process(es) (trainer.ddp=always: DDP for a single process)" in log

    done = torchrun([*ddp_args(tiny_dataset, tmp_path / "auto"), "trainer.ddp=auto"], ROOT, nproc=1)
    assert done.returncode == 0, done.stderr[-3000:]
    log = "".join(path.read_text() for path in (tmp_path / "auto").glob("*.log"))
    assert "epoch 1/1" in log and "process group:" not in log


@pytest.mark.slow
def test_ddp_always_outside_torchrun_fails_in_one_line(small_run_args):
    done = run_cli([*small_run_args, "trainer.ddp=always"], timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert lines[-1].startswith("error: trainer.ddp=always: not under torchrun (MASTER_ADDR is unset)"), lines


def test_run_dirs_are_plain_names_hydra_takes_as_one_run(tmp_path):
    check = gpu_check.Check(out=tmp_path, runs=tmp_path / "runs", data=tmp_path)
    for name in gpu_check.PART_NAMES:  # a comma in hydra.run.dir reads as a sweep
        assert re.fullmatch(r"[A-Za-z0-9_]+", gpu_check.run_dir_for(check, name).name), name


FAMILY = """
import os, signal, subprocess, sys, time
if sys.argv[2] == "ignore":  # a child deaf to SIGTERM (a stuck torchrun); SIG_IGN passes on to its children
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
same = subprocess.Popen(["sleep", "600"])  # a DataLoader worker: in the child's process group
# a torchrun rank: in a session of its own, out of reach of a group signal; with the pipes held or not
quiet = {} if sys.argv[3] == "pipes" else {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
apart = subprocess.Popen(["sleep", "600"], start_new_session=True, **quiet)
# an orphan: its parent (sh) ended at once, so it hangs from init, no longer the child's descendant; in its group still
orphan = subprocess.run(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True).stdout
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {same.pid} {apart.pid} {orphan}")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """Ended: no such process, or a zombie waiting for init to reap it."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def family_pids(pids: Path) -> list[int]:
    pid_list = [int(pid) for pid in pids.read_text().split()]
    assert len(pid_list) == 4
    return pid_list


@pytest.mark.slow
def test_a_command_past_its_limit_ends_with_its_grandchildren(tmp_path):
    """F5: the child, a grandchild in its group, one in a session of its own (torchrun's ranks) and an orphan in its
    group all end; a part's limit is a timeout, not a cut."""
    check = gpu_check.Check(out=tmp_path, runs=tmp_path, data=tmp_path)
    check.part_end = time.monotonic() + 8  # a limit far above the family's start-up
    pids = tmp_path / "pids"
    ok, line = gpu_check.run(check, [sys.executable, "-c", FAMILY, str(pids), "default", "devnull"])
    assert not ok and re.fullmatch(r"timed out after \d+ s", line), line
    for pid in family_pids(pids):
        wait_for(lambda pid=pid: gone(pid), 10, f"process {pid} to end")


@pytest.mark.slow
def test_the_deadline_cuts_a_command_that_ignores_sigterm_and_kills_the_rest(tmp_path):
    """SIGTERM CUT_S before the deadline, ignored, and a rank in its own session holding the pipes: SIGKILL at the
    deadline ends all three, and run() says the deadline cut the part."""
    started = time.monotonic()
    check = gpu_check.Check(out=tmp_path, runs=tmp_path, data=tmp_path, deadline=started + gpu_check.CUT_S + 8)
    pids = tmp_path / "pids"
    with pytest.raises(gpu_check.PartCut, match="cut at the deadline"):
        gpu_check.run(check, [sys.executable, "-c", FAMILY, str(pids), "ignore", "pipes"])
    assert time.monotonic() < check.deadline + 5  # the grace ends at the deadline
    for pid in family_pids(pids):
        wait_for(lambda pid=pid: gone(pid), 10, f"process {pid} to end")


def command_part(name: str, estimate_s: int, code: str) -> gpu_check.Part:
    """A part of one real command (a Python one-liner), run as gpu_check runs every part's commands."""
    return gpu_check.Part(name, code, lambda check: {"detail": gpu_check.run(check, [sys.executable, "-c", code])[1]},
                          estimate_s, cuda=False)


@pytest.mark.slow
def test_the_deadline_runs_what_fits_cuts_what_runs_over_and_starts_nothing_after(tmp_path):
    parts = [command_part("quick", 1, "print('done')"), command_part("too-long", 10**6, "print('never')"),
             command_part("sleeper", 1, "import time; time.sleep(600)"), command_part("after", 1, "print('never')")]
    check = gpu_check.Check(out=tmp_path, runs=tmp_path, data=tmp_path,
                            deadline=time.monotonic() + gpu_check.CUT_S + 10)
    report = {"parts": [], "pending": [part.name for part in parts]}
    gpu_check.run_parts(check, parts, report)
    written = json.loads((tmp_path / "report.json").read_text())
    assert written == report and written["pending"] == []
    rows = {row["part"]: row for row in written["parts"]}
    assert [(name, row["status"]) for name, row in rows.items()] == [
        ("quick", "passed"), ("too-long", "not run"), ("sleeper", "cut"), ("after", "not run")]
    assert rows["quick"]["detail"] == "done"
    assert rows["too-long"]["reason"].startswith("would not end before the deadline (about 1000000 s, ")
    assert rows["sleeper"]["reason"].startswith("cut at the deadline after ")
    assert time.monotonic() < check.deadline + 5


def test_the_short_plan_runs_the_default_path_first_and_ddp_last():
    assert [part.name for part in gpu_check.chosen(None, [], short=True)] == ["datasets", "a100", "decode", "resume",
                                                                               "ddp"]
    assert [part.name for part in gpu_check.chosen(["ddp", "a100"], ["decode"], short=True)] == ["a100", "ddp"]
    check = gpu_check.Check(out=Path(), runs=Path(), data=Path(), short=True)
    assert sum(part.estimate(check) for part in gpu_check.chosen(None, [], short=True)) <= 6.5 * 60


@pytest.mark.slow
def test_a_deadline_too_short_for_any_part_runs_none_and_exits_3(tmp_path):
    """Through the CLI: nothing starts that its estimate says cannot end in time (the set is not made), each such
    part is `not run` in report.json, and the exit status says the deadline left parts out."""
    if not torch.cuda.is_available() and gpu_check.gpu_present(CudaFacts.of_this_machine()):
        pytest.skip("an NVIDIA driver answers here: unusable CUDA is a broken GPU box, exit 2")
    done = gpu_check_run("--plan", "short", "--deadline-s", "1", "--out", str(tmp_path), "--data",
                         str(tmp_path / "data"))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "gpu-check: datasets not run: would not end before the deadline (about 45 s, " in done.stdout
    assert "the deadline (--deadline-s 1) left out: datasets (not run)" in done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert [row["part"] for row in report["parts"]] == gpu_check.SHORT_PLAN and report["pending"] == []
    assert {row["status"] for row in report["parts"]} <= {"not run", "skipped"}  # skipped: CUDA unusable here
    assert report["parts"][0]["status"] == "not run" and not (tmp_path / "data").exists()
