"""The cpu profile's precision: bf16 autocast decided from the CPU's flags, and the same accuracy as fp32."""

from __future__ import annotations

import logging

import pytest

from tests.conftest import compose_config, read_metrics, run_cli
from train.precision import cpu_flags, use_cpu_bf16


def test_auto_takes_bf16_only_where_the_cpu_has_it_and_says_so(caplog):
    caplog.set_level(logging.INFO)
    assert use_cpu_bf16("auto", flags={"avx512f", "avx512_bf16"})
    assert "bf16 autocast on" in caplog.text and "avx512_bf16" in caplog.text
    assert use_cpu_bf16("auto", flags={"amx_bf16", "amx_tile"})
    assert not use_cpu_bf16("auto", flags={"avx2", "avx512f"})
    assert "fp32" in caplog.records[-1].getMessage()
    assert use_cpu_bf16(True, flags=set()) and not use_cpu_bf16(False, flags={"avx512_bf16"})


def test_this_machine_has_flags_to_decide_from():
    assert "fpu" in cpu_flags() or not cpu_flags()  # Linux lists them; elsewhere auto means fp32


@pytest.mark.parametrize("profile", ["cpu", "auto"])
def test_cpu_profiles_take_channels_last_and_bf16_where_native(profile):
    cfg = compose_config([f"hardware={profile}"])
    assert cfg.trainer.channels_last is True and cfg.trainer.cpu_bf16 == "auto"


@pytest.mark.slow
def test_bf16_channels_last_learns_as_well_as_fp32(learn_dataset, tmp_path):
    """3 epochs on the learning set: the cpu profile with bf16 forced on (whatever this CPU) against fp32
    channels_first, the same data and seed."""
    accuracy = {}
    for name, extra in (("bf16", ["trainer.cpu_bf16=true"]),
                        ("fp32", ["trainer.cpu_bf16=false", "trainer.channels_last=false"])):
        run_dir = tmp_path / name
        result = run_cli(["hardware=cpu", f"data.root={learn_dataset}", "data.image_size=32", "data.batch_size=16",
                          "data.num_workers=2", "trainer.epochs=3", "trainer.progress=false",
                          f"hydra.run.dir={run_dir}", *extra])
        assert result.returncode == 0, result.stderr[-3000:]
        accuracy[name] = read_metrics(run_dir)[-1]["val_acc"]
    assert accuracy["fp32"] > 0.3 and accuracy["bf16"] > 0.3, accuracy  # 10 classes: chance is 0.1
    assert abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.1, accuracy
