"""Every command in README.md and docs/*.md runs as typed, after the README's own set-up (`make setup`/`make train`,
then `source .venv/bin/activate`): each fenced command line is run in a bash that activates the venv exactly so, from
the repository root, with .venv/bin taken off PATH first (a command that works only because the test's own
interpreter is on PATH proves nothing).

Commands run short: `python -m train`, `torchrun -m train`, `make train` and `make torchrun` print the composed config
(`--cfg job`, which composes and type-checks every override); a script prints its `--help`; `REAL` lists the few that
train or sweep for real, a few steps; `CANNOT` lists those that cannot run on this box, each with the reason. A
command in neither list is run by default, so a new one is checked the day it is written.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "gpu.md")]  # gpu.md: new
ACTIVATE = "source .venv/bin/activate"
SHELLS = ("bash", "sh", "shell", "console")
NOT_COMMANDS = (  # untagged fenced blocks that are pictures or output, not commands (their first line)
    "conf/config.yaml + groups",  # README: the path of one batch
    "conf/       Hydra configs",  # README: the layout
    "error: trainer.metrics_port=9400",  # docs/monitoring.md: what a port in use prints
)

NEEDS_GPU = "needs CUDA (a GPU profile)"
NEEDS_DOCKER = "needs Docker (tests/infra/test_container.sh runs compose for real)"
NEEDS_LENT_GPU = "the lent GPU machine ($OUT is its output folder); tests/test_gpu_harness.py runs the CPU share"
NEEDS_S3 = "needs an S3 store and the aws CLI (tests/test_shards.py runs a local S3 server)"
CANNOT = {
    "make test": "the test suite this test belongs to",
    "torchrun --standalone --nproc_per_node=8 -m train hardware=a100 dataset=imagefolder data.root=/data/imagenet":
        "8 GPUs and /data/imagenet (`make torchrun NPROC=2` runs the same path on the CPU)",
    "torchrun --standalone --nproc_per_node=8 -m train hardware=a100 data.root=/data/imagenet dataset=imagefolder":
        "8 GPUs and /data/imagenet (`make torchrun NPROC=2` runs the same path on the CPU)",
    "torchrun --standalone --nproc_per_node=8 -m train trainer.resume=auto hydra.run.dir=outputs/torchrun/<run id>":
        "a template: <run id> is the reader's",
    "make gpu-wheels": "downloads from PyPI; tests/test_gpu_harness.py runs it and resolves the set offline",
    "python3 scripts/gpu_check.py --plan short --deadline-s 480 --out $OUT": NEEDS_LENT_GPU,
    "nvidia-smi && python3 scripts/gpu_check.py --only cuda-tests,compile --deadline-s 300 --out $OUT": NEEDS_LENT_GPU,
    "NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 RDZV_ID=job42 ./scripts/launch_multinode.sh hardware=a100":
        "two nodes, node0 the first (tests/test_distributed.py runs two agents on this box)",
    "NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 RDZV_ID=resnet50-a ./scripts/launch_multinode.sh hardware=a100 "
    "data.root=/data/imagenet": "two nodes, node0 the first (tests/test_distributed.py runs two agents on this box)",
    "sbatch scripts/slurm/train.sbatch": "a Slurm cluster (tests/test_cluster.py starts one)",
    "kubectl apply -f scripts/k8s/pytorchjob.yaml": "a Kubernetes cluster with the Kubeflow training operator",
    "sudo make slurm": "root and apt: installs slurm-wlm and munge on this machine",
    "aws s3 sync data/shards s3://my-bucket/shards": NEEDS_S3,
    "aws s3 mb s3://shards && aws s3 sync data/shards s3://shards/synthetic": NEEDS_S3,
    "make tensorboard": "a server that runs until stopped",
    "make tensorboard TB_HOST=0.0.0.0": "a server that runs until stopped",
    "python -m train.tune -m hardware=rtx4080 data.root=/data/imagenet dataset=imagefolder "
    "data.num_workers=0,2,4,6 data.pin_memory=true,false data.prefetch_factor=2,4": NEEDS_GPU + " and /data/imagenet",
    'make tune SWEEP="data.num_workers=2,4,6,8 data.prefetch_factor=2,4" ARGS="hardware=rtx4080"': NEEDS_GPU,
    "docker compose build": NEEDS_DOCKER,
    "docker compose run --rm train hardware=rtx4080 data.num_workers=4 data.pin_memory=false": NEEDS_DOCKER,
    "HARDWARE=cpu docker compose run --rm train hardware=cpu data.num_workers=2 trainer.epochs=1": NEEDS_DOCKER,
    'docker run --rm --gpus all --shm-size=8g -v "$PWD/data:/app/data:ro" -v "$PWD/outputs:/app/outputs" '
    "loadout:latest hardware=a100": NEEDS_DOCKER,
    "docker compose --profile jupyter up --build jupyter": NEEDS_DOCKER,
    "docker buildx imagetools inspect pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime": NEEDS_DOCKER,
    "docker build --build-arg BASE_IMAGE=pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime@sha256:<digest> -t loadout .":
        NEEDS_DOCKER,
    "docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3 --build-arg TORCH_FROM_BASE=1 -t loadout .":
        NEEDS_DOCKER,
    "BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3 TORCH_FROM_BASE=1 HARDWARE=rtx4080 docker compose up --build":
        NEEDS_DOCKER,
    "HARDWARE=rtx4080 docker compose up": NEEDS_DOCKER,
    "HARDWARE=cpu docker compose up": NEEDS_DOCKER,
    "docker compose run --rm train data.num_workers=4 data.pin_memory=false": NEEDS_DOCKER,
    "HARDWARE=a100 NPROC=4 docker compose --profile multi up train-multi": NEEDS_DOCKER,
    "JUPYTER_TOKEN=$(openssl rand -hex 24) docker compose --profile jupyter up jupyter": NEEDS_DOCKER,
    'HARDWARE=rtx4080 TRAIN_ARGS="trainer.metrics_port=9400 trainer.metrics_host=0.0.0.0" '
    "GRAFANA_ADMIN_PASSWORD=$(openssl rand -hex 16) docker compose --profile monitoring up": NEEDS_DOCKER,
    "MINIO_ROOT_PASSWORD=$(openssl rand -hex 16) docker compose --profile storage up -d minio": NEEDS_DOCKER,
    "export AWS_ENDPOINT_URL=http://127.0.0.1:9000 AWS_ACCESS_KEY_ID=loadout AWS_SECRET_ACCESS_KEY=<that password>":
        "a template: <that password> is the reader's",
    "python -m train task=segmentation dataset=parquet data.root=<root> dataset.mask_column=annotation "
    "'dataset.classes=[background,circle,square,triangle,cross]'":
        "a template: <root> is the reader's parquet (tests/test_segmentation_stores.py trains from one)",
    'AWS_ENDPOINT_URL=http://minio:9000 TRAIN_ARGS="dataset=shards data.root=s3://shards/synthetic" docker compose up':
        NEEDS_DOCKER,
}

SMALL_RUN = "hardware=cpu trainer.max_steps=2 trainer.progress=false hydra.run.dir=$(mktemp -d -p {tmp})"
REAL = {  # command -> what is appended: these train (or sweep) for real, a few steps, in a tmp dir
    "python -m train hardware=cpu trainer.epochs=1 trainer.max_steps=50": SMALL_RUN,
    "python examples/csv_dataset/make_csv.py data/synthetic": "",
    "PYTHONPATH=examples/csv_dataset python -m train dataset._target_=csv_images.CsvImages "
    "+dataset.csv=data/synthetic/list.csv": SMALL_RUN,
    "WANDB_MODE=offline python -m train 'logger=[wandb]' logger.wandb.project=mine": SMALL_RUN,
    "python -m train 'logger=[mlflow]'": SMALL_RUN,
}
# one epoch of two batches a setting; autotune writes the tmp dir's profile, not conf/'s
TUNE_ARGS = ("tune.repeats=1 tune.warmup_batches=1 tune.batches=2 tune.plot=false "
             "hydra.sweep.dir=$(mktemp -d -p {tmp}) tune.profile_path={tmp}/conf/hardware/local.yaml")


def logical_lines(block: str) -> list[str]:
    """A fenced block's commands: continuation lines joined, comments and blank lines dropped."""
    commands, current = [], ""
    for line in block.splitlines():
        current += line.strip()
        if current.endswith("\\"):
            current = current[:-1].rstrip() + " "
            continue
        command = strip_comment(current).strip()
        if command:
            commands.append(re.sub(r"\s+", " ", command))
        current = ""
    return commands


def strip_comment(line: str) -> str:
    """`line` without a trailing `# comment` (a # outside quotes, at the start or after a space)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) for every command line in a fenced block of the docs, in order."""
    found = []
    fence = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)
    for doc in DOCS:
        for match in fence.finditer(doc.read_text()):
            tag, body = match.group(2), match.group(3)
            if tag in SHELLS or (not tag and not body.lstrip().startswith(NOT_COMMANDS)):
                found += [(doc.name, command) for command in logical_lines(body)]
    return found


COMMANDS = documented_commands()


def as_run(command: str, tmp: Path) -> str:
    """The command as this test runs it: shortened as the module docstring says."""
    if command in REAL:
        return f"{command} {REAL[command].format(tmp=tmp)}".strip()
    make = re.match(r"make (train|torchrun|tune)\b(.*)$", command)
    if make:
        target, rest = make.groups()
        if target == "tune":  # two settings, one epoch of two batches each
            rest = re.sub(r'\s*SWEEP="[^"]*"', "", rest) + ' SWEEP="data.num_workers=0,1"'
            extra = TUNE_ARGS.format(tmp=tmp)
        else:
            extra = "--cfg job"
        if "hardware=local" in rest:  # the profile `make tune ARGS="tune.autotune=true"` wrote just before
            extra += f" hydra.searchpath=[file://{tmp}/conf]"
        if 'ARGS="' not in rest:
            return f'make {target}{rest} ARGS="{extra}"'
        return "make " + target + re.sub(r'ARGS="([^"]*)"', lambda m: f'ARGS="{m.group(1)} {extra}"', rest, count=1)
    if re.search(r"(^|\s)(python -m train|torchrun .*-m train)(\s|$)", command):
        return command if "--cfg" in command else f"{command} --cfg job"
    if re.search(r"(^|\s)python \S+\.py(\s|$)", command):
        return f"{command} --help"
    return command


def shell_env(home: Path) -> dict:
    """This environment as a new shell has it: no venv on PATH, no W&B/MLflow settings, HOME without a ~/.netrc."""
    venv_bin = str(ROOT / ".venv" / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p.rstrip("/") != venv_bin)
    env = {key: value for key, value in os.environ.items()
           if key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME") and not key.startswith(("WANDB_", "MLFLOW_"))}
    return {**env, "PATH": path, "HOME": str(home)}


def test_the_readme_says_how_to_activate_the_venv_once():
    assert ("README.md", ACTIVATE) in COMMANDS
    setup = [command for doc, command in COMMANDS if doc == "README.md"]
    assert setup.index(ACTIVATE) == setup.index("make test") + 1  # right after the set-up, before any other command


def test_every_listed_exception_is_still_documented():
    """A stale entry in CANNOT or REAL hides nothing today but would hide a reworded command tomorrow."""
    documented = {command for _, command in COMMANDS}
    assert set(CANNOT) <= documented, set(CANNOT) - documented
    assert set(REAL) <= documented, set(REAL) - documented


@pytest.fixture(scope="module")
def shell_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """One tmp dir for the module: `make tune ARGS="tune.autotune=true"` writes the profile the next command trains
    with."""
    return tmp_path_factory.mktemp("commands")


@pytest.mark.slow  # a shell and a Python start per command: `make test` runs them, test-fast checks the lists above
@pytest.mark.parametrize("doc, command", COMMANDS, ids=[f"{doc}: {command[:70]}" for doc, command in COMMANDS])
def test_command_runs_as_typed(doc, command, shell_home, scratch):
    if command in CANNOT:
        pytest.skip(CANNOT[command])
    if not (ROOT / ".venv" / "bin" / "activate").is_file():
        pytest.skip("no .venv here: the README's set-up (make setup) was not run")
    typed = as_run(command, scratch)
    result = subprocess.run(["bash", "-c", f"set -e; {ACTIVATE}; {typed}"], cwd=ROOT, env=shell_env(shell_home),
                            capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{doc}: `{typed}` exited {result.returncode}:\n{output[-3000:]}"
    assert "Traceback" not in output and "No module named" not in output, output[-3000:]
