"""The doctor names a slow store (loadout/observe/doctor.py): shards served by nginx behind the real latency proxy
(tests/infra/latency_proxy.py), nothing fetched ahead, a real worker downloading each shard as it reaches it: the
epoch is read/fetch-bound and the fix is to fetch shards further ahead."""

from __future__ import annotations

import logging

import pytest
import torch

from loadout.dist import DistEnv
from tests.conftest import compose_config, read_metrics, trainer_for
from tests.test_shards import nginx_serving, start_proxy
from train.job import data_from_config

CPU = torch.device("cpu")
DELAY_MS = 200  # a store this far away: each shard's download waits at least this long


@pytest.fixture
def far_http(shards, tmp_path):
    """The shards over HTTP, DELAY_MS a request away; yields the base URL."""
    (tmp_path / "nginx").mkdir()
    with nginx_serving(shards, tmp_path / "nginx") as url:
        proxy, proxied = start_proxy(url, DELAY_MS)
        try:
            yield proxied
        finally:
            proxy.kill()
            proxy.wait()


@pytest.mark.slow  # starts nginx and scripts/make_shards.py
@pytest.mark.usefixtures("one_thread_steps")  # the store's waits against a step that load cannot stretch ~50x
def test_a_far_store_with_nothing_fetched_ahead_is_named_read_bound_with_fetch_ahead_as_the_fix(far_http, tmp_path,
                                                                                                caplog):
    cfg = compose_config(["hardware=cpu", "dataset=shards", f"data.root={far_http}", "data.image_size=32",
                          "data.batch_size=16", "data.num_workers=1", "dataset.prefetch_shards=0",
                          f"dataset.cache_dir={tmp_path / 'cache'}", "trainer.epochs=1", "trainer.progress=false",
                          "logger=[]", "model._target_=tests.tiny_net.TinyNet"])
    with caplog.at_level(logging.INFO, logger="loadout.observe.doctor"), data_from_config(cfg, DistEnv(), CPU) as data:
        trainer = trainer_for(cfg, data, tmp_path / "run")
        trainer.fit()
    record = read_metrics(tmp_path / "run")[-1]
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("doctor: ")][-1]
    assert record["bound"] == "read/fetch", line
    assert max(("read", "decode", "augment", "collate"), key=lambda s: record[f"{s}_share"]) == "read", record
    assert line.startswith("doctor: read/fetch-bound") and "prefetch_shards=" in line and "(now 0)" in line, line
