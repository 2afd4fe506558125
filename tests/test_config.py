"""Profiles compose with their values, the command line wins, and bad input fails with the key and the fix."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from loadout.data.loader.plan import num_workers_for
from loadout.errors import ConfigError
from tests.conftest import compose_config, run_cli
from train.config import validate

PROFILES = {
    "rtx3060": dict(batch_size=32, num_workers=3, pin_memory=True, prefetch_factor=2, persistent_workers=False),
    "rtx4080": dict(batch_size=64, num_workers=6, pin_memory=True, prefetch_factor=3, persistent_workers=True),
    "a100": dict(batch_size=128, num_workers=12, pin_memory=True, prefetch_factor=4, persistent_workers=True,
                 sampler="auto"),
    "cpu": dict(batch_size=32, num_workers="auto", pin_memory=False, prefetch_factor=None),
}


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_profile_carries_its_values(profile):
    cfg = compose_config([f"hardware={profile}"])
    for key, expected in PROFILES[profile].items():
        assert cfg.data[key] == expected, f"hardware={profile}: data.{key}"
    validate(cfg)


@pytest.mark.parametrize("profile", ["rtx3060", "rtx4080", "a100"])
def test_gpu_profiles_train_on_cuda_with_precision_auto_and_channels_last(profile):
    cfg = compose_config([f"hardware={profile}"])
    assert cfg.trainer.device == "cuda" and cfg.trainer.precision == "auto" and cfg.trainer.channels_last
    assert cfg.data.image_size == 224


def test_auto_profile_follows_the_machine():
    cfg = compose_config([])
    OmegaConf.resolve(cfg)
    has_cuda = torch.cuda.is_available()
    assert cfg.data.num_workers == "auto"
    assert cfg.data.pin_memory is has_cuda
    assert cfg.trainer.device == "auto" and cfg.trainer.precision == "auto"


def test_command_line_wins_over_profile():
    cfg = compose_config(["hardware=rtx3060", "data.num_workers=2", "data.pin_memory=false", "data.batch_size=8"])
    assert (cfg.data.num_workers, cfg.data.pin_memory, cfg.data.batch_size) == (2, False, 8)
    assert cfg.data.prefetch_factor == 2  # untouched keys keep the profile's value


def test_every_dataloader_knob_is_overridable():
    overrides = ["data.shuffle=false", "data.sampler=sequential", "data.num_workers=1", "data.pin_memory=true",
                 "data.prefetch_factor=5", "data.persistent_workers=true", "data.drop_last=false", "data.timeout=30.5",
                 "data.multiprocessing_context=spawn", "data.in_order=false", "data.non_blocking=false"]
    cfg = compose_config(["hardware=cpu", *overrides])
    for item in overrides:
        key, value = item.split("=")
        assert str(OmegaConf.select(cfg, key)).lower() == value


def test_num_workers_auto_divides_cores_among_local_processes():
    assert num_workers_for("auto", local_world_size=1, cores=16) == 12
    assert num_workers_for("auto", local_world_size=4, cores=16) == 3
    assert num_workers_for("auto", local_world_size=8, cores=4) == 0
    assert num_workers_for(5, local_world_size=8, cores=4) == 5  # typed on the command line: as it is


@pytest.mark.parametrize("override, message", [
    ("data.num_wrkers=2", "num_wrkers"),
    ("data.batch_size=big", "data.batch_size"),
    ("data.pin_memory=maybe", "data.pin_memory"),
    ("trainer.epoch=3", "epoch"),
    ("data.sampler=shuffled", "data.sampler"),
])
def test_typos_and_wrong_types_fail_at_composition(override, message):
    with pytest.raises(ConfigCompositionException) as err:
        compose_config([override])
    assert message in str(err.value) + str(err.value.__cause__)


@pytest.mark.parametrize("overrides, key, fix", [
    (["hardware=rtx3060", "data.num_workers=0"], "data.prefetch_factor=2", "data.prefetch_factor=null"),
    (["hardware=cpu", "data.num_workers=0"], "data.persistent_workers=true", "data.persistent_workers=false"),
    (["data.num_workers=-1"], "data.num_workers=-1", "integer >= 0"),
    (["data.num_workers=many"], "data.num_workers='many'", "auto"),
    (["data.batch_size=-4"], "data.batch_size=-4", "positive"),
    (["data.timeout=-1"], "data.timeout=-1", ">= 0"),
    (["data.prefetch_factor=0"], "data.prefetch_factor=0", ">= 1"),
    (["trainer.epochs=0"], "trainer.epochs=0", "positive"),
    (["trainer.max_steps=-1"], "trainer.max_steps=-1", "positive"),
    (["trainer.resume=/no/such/file.pt"], "trainer.resume", "no such checkpoint"),
])
def test_bad_combinations_name_the_key_and_the_fix(overrides, key, fix):
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert key in str(err.value) and fix in str(err.value)


def test_a_profiles_fixed_workers_are_capped_under_torchrun_and_typed_ones_warn(caplog):
    caplog.set_level(logging.INFO)
    assert num_workers_for(12, local_world_size=8, typed=False, cores=64) == 6  # a100 on 8 GPUs, 64 cores
    assert "capped to 6 per process" in caplog.text
    assert num_workers_for(12, local_world_size=8, typed=True, cores=64) == 12
    assert "oversubscribes" in caplog.records[-1].getMessage() and caplog.records[-1].levelno == logging.WARNING
    assert num_workers_for(3, local_world_size=4, typed=False, cores=2) == 1  # at least one when workers were asked
    assert num_workers_for(0, local_world_size=4, typed=False, cores=2) == 0
    assert num_workers_for(12, local_world_size=1, typed=False, cores=4) == 12  # one process: the profile as is
    assert num_workers_for("auto", local_world_size=8, typed=False, cores=64) == 6


@pytest.mark.slow
def test_under_torchrun_a_profile_worker_count_is_capped_in_one_line(small_run_args):
    """A rank as torchrun starts it, 4 processes on this node: rtx3060's 3 workers become max(1, 0.75 x cores / 4)."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "4"}
    result = run_cli([*small_run_args, "hardware=rtx3060", "data.pin_memory=false", "trainer.device=cpu",
                      "data.image_size=32", "trainer.epochs=1", "trainer.max_steps=1"], env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert out.count("data.num_workers: the profile's 3 capped to") == 1, out[-3000:]


@pytest.mark.parametrize("override, line", [
    ("data.decode=devcie", "data.decode=devcie: data.decode takes one of cpu, device, not 'devcie'"),
    ("data.multiprocessing_context=thread", "takes one of fork, spawn, forkserver or null, not 'thread'"),
    ("trainer.precision=fp8", "trainer.precision takes one of auto, bf16, fp16, fp32, not 'fp8'"),
    ("trainer.compile_mode=fast", "takes one of default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs"),
])
def test_a_closed_choice_names_its_choices_in_one_line(override, line):
    from loadout.run.overrides import check_command_line
    from train.config import SCHEMA

    with pytest.raises(ConfigError) as err:
        check_command_line([override], SCHEMA)
    assert line in str(err.value) and "\n" not in str(err.value)


def test_closed_choices_read_and_save_as_plain_text():
    """An Enum field equals its text, saves as it (an old run's config.yaml holds plain strings), reaches the
    trackers as its text and shows in a one-line error as typed."""
    from loadout.errors import shown
    from loadout.observe.trackers import flat_params

    cfg = compose_config(["data.on_bad_sample=raise", "trainer.compile_mode=reduce-overhead", "data.decode=device"])
    assert cfg.data.on_bad_sample == "raise" and cfg.data.decode == "device" and f"{cfg.data.decode}" == "device"
    assert "compile_mode: reduce-overhead" in OmegaConf.to_yaml(cfg)
    params = flat_params(cfg)
    assert params["data.decode"] == "device" and params["trainer.compile_mode"] == "reduce-overhead"
    assert shown(cfg.data.decode) == "'device'"
    with pytest.raises(ConfigError, match=r"^data.decode='device': "):
        validate(compose_config(["data.decode=device", "data.device_transforms=false"]))


@pytest.mark.parametrize("override, line", [
    ("dataset.shuffle_window=0", "dataset.shuffle_window=0: use an integer >= 1, or null"),
    ("dataset.prefetch_shards=-1", "dataset.prefetch_shards=-1: use an integer >= 0"),
    ("dataset.cache_bytes=-5", "dataset.cache_bytes=-5: use an integer >= 0"),
])
def test_a_sharded_datasets_store_settings_fail_before_anything_is_read(override, line, tmp_path):
    from loadout.data.remote.shards import ShardSource

    cfg = compose_config(["dataset=shards", override])
    spec = {key: value for key, value in OmegaConf.to_container(cfg.dataset).items() if key != "_target_"}
    with pytest.raises(ConfigError, match=line):
        ShardSource(**{**spec, "root": str(tmp_path / "none")})


def old_run_dir(root: Path, overrides: str, saved_dataset: str) -> Path:
    """A run dir as runs from before the store knobs moved wrote it: its overrides and its config.yaml."""
    (root / ".hydra").mkdir(parents=True)
    (root / ".hydra" / "overrides.yaml").write_text(overrides)
    (root / ".hydra" / "config.yaml").write_text(
        "data:\n  shard_cache_dir: /old-cache\n  shard_cache_bytes: 0\n  shuffle_window: null\n  prefetch_shards: 8\n"
        f"dataset:\n{saved_dataset}")
    return root


def test_the_store_settings_left_data_and_an_old_run_replays_them_under_dataset(tmp_path):
    from loadout.run.overrides import check_command_line
    from loadout.run.resume_run import replay
    from train.config import SCHEMA

    for dataset in ("shards", "imagefolder"):  # a moved key is named whichever dataset is chosen
        with pytest.raises(ConfigError, match="^data.shard_cache_dir: did you mean dataset.cache_dir"):
            check_command_line([f"dataset={dataset}", "data.shard_cache_dir=/c"], SCHEMA)
    shards = old_run_dir(tmp_path / "shards", "- dataset=shards\n- data.shuffle_window=2\n- data.prefetch_shards=0\n"
                         "- data.shard_cache_dir=/c\n", "  _target_: x\n  cache_dir: ${data.shard_cache_dir}\n"
                         "  shuffle_window: ${data.shuffle_window}\n  prefetch_shards: 8\n")
    cfg = check_command_line([o for o in replay(["trainer.resume=auto"], shards) if not o.startswith("hydra.")],
                             SCHEMA)
    assert (cfg.dataset.shuffle_window, cfg.dataset.prefetch_shards, cfg.dataset.cache_dir) == (2, 0, "/c")
    # a folder never read them: they are left out; a mix source's spec that quoted one gets the run's value
    folder = old_run_dir(tmp_path / "folder", "- data.prefetch_shards=0\n- data.shuffle_window=3\n",
                         "  _target_: x\n  root: ${data.root}\n")
    assert replay(["trainer.resume=auto"], folder) == ["trainer.resume=auto", "hydra.output_subdir=null"]
    mix = old_run_dir(tmp_path / "mix", "- dataset=mix\n- data.shard_cache_dir=/c\n"
                      "- '+dataset.sources.web={_target_: loadout.data.datasets.ShardSource, weight: 1, "
                      "cache_dir: \"${data.shard_cache_dir}\"}'\n", "  _target_: x\n  shuffle_window: null\n")
    argv = replay(["trainer.resume=auto"], mix)
    assert argv[:2] == ["dataset=mix", "+dataset.sources.web={_target_: loadout.data.datasets.ShardSource, weight: 1, "
                        'cache_dir: "/old-cache"}']
    cfg = check_command_line([o for o in argv if not o.startswith("hydra.")], SCHEMA)
    assert cfg.dataset.sources.web.cache_dir == "/old-cache"


def test_a_sweep_with_a_value_outside_a_choice_fails_in_the_same_line():
    from hydra import initialize_config_dir

    from train import CONF
    from train.config import check_sweep, register, register_tune

    register()
    register_tune()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"), pytest.raises(ConfigError) as err:
        check_sweep("tune", ["hardware=cpu", "data.decode=cpu,devcie"])
    assert str(err.value) == "data.decode=devcie: data.decode takes one of cpu, device, not 'devcie'"
