"""dataset=shards and dataset=parquet with real parts: shards written by scripts/make_shards.py and by webdataset's
ShardWriter, parquet in the Hub's layout, read map-style from a folder, from nginx over HTTP and from an
S3-compatible server (moto's, on 127.0.0.1); the shard window order over ranks; exact resume; 2 torchrun ranks."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from loadout.data.datasets import ImageFolderDataset
from loadout.data.loader.samplers import ShardWindowSampler
from loadout.data.remote.shard_store import ShardError, ShardStore
from loadout.data.remote.shards import ShardSource
from loadout.dist import DistEnv
from loadout.errors import ConfigError
from tests.conftest import ROOT, compose_config, read_metrics, run_cli, wait_for, whole_and_resumed
from train.job import data_from_config

CPU = torch.device("cpu")
SECRET = "not-a-real-secret-8f3c"  # the S3 secret key the tests use: it must never show in a message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read() if proc.stderr else ''}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port}")


def labels(source) -> list[int]:
    return [source.read_encoded(index)[1] for index in range(len(source))]


def member_key(source: ShardSource, index: int) -> str:
    shard = int(np.searchsorted(source.shard_starts, index, side="right")) - 1
    return source.members(shard)["keys"][index - source.shard_starts[shard]].decode()


@pytest.mark.slow  # starts a server or scripts/make_shards.py
def test_make_shards_lists_each_shards_labels_so_the_order_keeps_a_small_window(shards, tmp_path):
    """make_shards.py writes shuffled shards and says so in _info.json (`labels_per_shard`): the default window stays
    DEFAULT_WINDOW shards (reads mostly in sequence) and no shard is read at build to tell."""
    import json

    from loadout.data.remote.shard_order import DEFAULT_WINDOW, shard_window

    train = json.loads((shards / "_info.json").read_text())["splits"]["train"]
    assert len(train["labels_per_shard"]) == len(train["filenames"]) > DEFAULT_WINDOW
    source = ShardSource(str(shards), "train", cache_dir=str(tmp_path / "cache"))
    assert source.label_spread().mixed
    assert shard_window(source.shard_starts, None, source.label_spread) == DEFAULT_WINDOW
    assert not list((tmp_path / "cache").glob("*.index.npz")), "nothing read to tell"


@pytest.mark.slow  # starts a server or scripts/make_shards.py
def test_shards_hold_the_folder_samples_map_style(shards, tiny_dataset, tmp_path):
    source = ShardSource(str(shards), "train", cache_dir=str(tmp_path / "cache"))
    folder = ImageFolderDataset(tiny_dataset, "train")
    assert len(source) == len(folder) == 240 and source.classes == folder.classes
    assert len(source.shard_starts) > 8 and len(set(np.diff(source.shard_starts).tolist())) > 1  # uneven
    assert not list((tmp_path / "cache").glob("*.index.npz")), "with _info.json counts, nothing indexed at build"
    for index in (0, 17, 239):
        key = int(member_key(source, index))
        image, label = source[index]
        assert torch.equal(image, folder[key][0]) and label == folder[key][1]
    again = subprocess.run([sys.executable, "scripts/make_shards.py", str(tiny_dataset), str(tmp_path / "again"),
                            "--shard-bytes", "23000"], cwd=ROOT, check=True, capture_output=True)
    assert again.returncode == 0
    assert (tmp_path / "again" / "train" / "shard-000003.tar").read_bytes() == \
        (shards / "train" / "shard-000003.tar").read_bytes(), "deterministic: the same input, the same bytes"


@pytest.mark.parametrize("tar_format", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_the_index_built_as_bytes_arrive_is_tarfiles_in_any_chunking_and_cut_anywhere(tar_format, tmp_path):
    """Long and non-ASCII names (pax records, GNU long names), folders, `.cls` and `.json` labels: the one-pass index
    (fed in chunks of any size, or from the mapped file) holds what tarfile says, also for a shard cut short."""
    import io
    import json

    from loadout.data.remote.tar_index import TarIndexer, index_file

    path = tmp_path / "shard.tar"
    with tarfile.open(path, "w", format=tar_format) as tar:
        for i in range(12):
            key = f"part{i % 3}/{'long' * 30 if i % 4 == 0 else ''}s{i:03d}{'é' if i % 5 == 0 else ''}"
            label = str(i % 7).encode() if i % 2 else json.dumps({"label": i % 7}).encode()
            for name, payload in ((f"{key}.jpg", bytes([i]) * (700 * i)), (f"{key}.{'cls' if i % 2 else 'json'}",
                                                                         label)):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            if i == 5:  # not a file: no sample
                folder = tarfile.TarInfo("part1/a-folder")
                folder.type = tarfile.DIRTYPE
                tar.addfile(folder)
    data = path.read_bytes()
    for cut in (len(data), len(data) * 2 // 3, len(data) // 3 + 700):
        (tmp_path / "cut.tar").write_bytes(data[:cut])
        with tarfile.open(tmp_path / "cut.tar") as tar:
            try:
                expected = {m.name: (m.offset_data, m.size) for m in tar if m.offset_data + m.size <= cut}
            except tarfile.ReadError:  # tarfile's own "unexpected end of data": what it listed stands
                expected = {m.name: (m.offset_data, m.size) for m in tar.members if m.offset_data + m.size <= cut}
        images = {name.rsplit(".", 1)[0].encode(): where for name, where in expected.items() if name.endswith(".jpg")
                  and any(other.startswith(name[:-3]) and other[-3:] in ("cls", "son") for other in expected)}
        for chunk in (1, 511, 4096, cut):
            indexer = TarIndexer("shard.tar")
            for start in range(0, cut, chunk):
                indexer.feed(data[start:min(start + chunk, cut)])
            index = indexer.finish()
            assert dict(zip(index["keys"].tolist(), zip(index["offsets"].tolist(), index["sizes"].tolist(),
                                                        strict=True), strict=True)) == images, (cut, chunk)
            assert index["labels"].tolist() == [int(k.decode().rsplit("s", 1)[1][:3]) % 7 for k in index["keys"]]
        assert {k: v.tolist() for k, v in index_file(tmp_path / "cut.tar").items()} == \
            {k: v.tolist() for k, v in index.items()}
    (tmp_path / "not.tar").write_bytes(b"not a tar file at all" * 100)
    with pytest.raises(tarfile.ReadError):
        index_file(tmp_path / "not.tar")


def test_webdataset_shardwriter_shards_read_as_they_are(tiny_dataset, tmp_path):
    import webdataset

    folder = ImageFolderDataset(tiny_dataset, "train")
    for split in ("train", "val"):
        (tmp_path / "wds" / split).mkdir(parents=True)
        source = ImageFolderDataset(tiny_dataset, split)
        with webdataset.ShardWriter(str(tmp_path / "wds" / split / "part-%04d.tar"), maxcount=50) as sink:
            for index in range(len(source)):
                sink.write({"__key__": f"s{index:05d}", "jpg": source.read_encoded(index)[0],
                            "cls": int(source.targets[index]), "json": {"note": "ignored"}})
    shard_source = ShardSource(str(tmp_path / "wds"), "train", cache_dir=str(tmp_path / "cache"))
    assert len(shard_source) == 240 and len(shard_source.shard_starts) == 6  # 5 shards of <= 50
    assert labels(shard_source) == folder.targets.tolist()  # no _info.json: every shard indexed at build
    assert torch.equal(shard_source[100][0], folder[100][0])


def test_weighted_sampling_over_shards_is_refused_in_one_line(shards, tmp_path):
    cfg = compose_config(["hardware=cpu", "dataset=shards", f"data.root={shards}", "data.sampler=weighted",
                          f"dataset.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ConfigError, match="data.sampler=weighted: the dataset offers no `targets`"):
        data_from_config(cfg, DistEnv(), CPU)


def test_fetch_ahead_keeps_the_order_fetches_what_it_reaches_next_and_ends_its_threads():
    import threading

    from torch.utils.data import SequentialSampler

    from loadout.data.remote.fetch_ahead import FetchAhead

    def fetch_ahead_threads() -> int:
        return sum(thread.name == "loadout-fetch-ahead" for thread in threading.enumerate())

    fetched: list[int] = []
    sampler = FetchAhead(SequentialSampler(range(20)), np.array([0, 5, 10, 15, 20]), fetched.append, ahead=1)
    order = iter(sampler)
    first = next(order)
    wait_for(lambda: len(fetched) >= 2, 10, "the shard in use and the next")
    time.sleep(0.3)
    assert sorted(fetched) == [0, 1], "the shard reached and one ahead, no further"
    assert [first, *order] == list(range(20)), "the order unchanged"
    wait_for(lambda: fetch_ahead_threads() == 0, 10, "the threads to end with their order")
    abandoned = iter(sampler)
    next(abandoned)
    abandoned.close()  # a seek or a closed loader
    wait_for(lambda: fetch_ahead_threads() == 0, 10, "the threads to end with an abandoned order")


def test_fetch_ahead_has_several_downloads_in_flight_at_once():
    """One stream's round trips fall behind the workers (bench/shards.py): the next shards download side by side."""
    import threading

    from torch.utils.data import SequentialSampler

    from loadout.data.remote.fetch_ahead import FETCHES_AT_ONCE, FetchAhead

    release, lock, in_flight, most = threading.Event(), threading.Lock(), [0], [0]

    def slow_fetch(shard: int) -> None:
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        release.wait(10)
        with lock:
            in_flight[0] -= 1

    sampler = FetchAhead(SequentialSampler(range(100)), np.arange(0, 101, 10), slow_fetch, ahead=8)
    order = iter(sampler)
    next(order)
    wait_for(lambda: most[0] == FETCHES_AT_ONCE, 10, f"{FETCHES_AT_ONCE} fetches in flight")
    time.sleep(0.2)
    assert most[0] == FETCHES_AT_ONCE, "no more than FETCHES_AT_ONCE at once"
    release.set()
    assert len([0, *order]) == 100


def test_the_window_order_splits_uneven_shards_equally_over_ranks_and_covers_every_sample():
    starts = np.array([0, 7, 20, 21, 40, 55, 61])  # 61 samples in 6 uneven shards
    ranks = [ShardWindowSampler(starts, window=2, seed=3, rank=r, world_size=2) for r in (0, 1)]
    for sampler in ranks:
        sampler.set_epoch(1)
    orders = [list(sampler) for sampler in ranks]
    assert len(orders[0]) == len(orders[1]) == 31  # equal steps: no rank waits in a collective
    assert set(orders[0]) | set(orders[1]) == set(range(61))  # one sample seen twice
    whole = ranks[0].order()
    shard_of = np.searchsorted(starts, whole, side="right") - 1
    changes = int((np.diff(shard_of) != 0).sum())
    assert changes < 30, "windows of 2 shards: read mostly in sequence, not sample by sample"
    ranks[0].set_epoch(2)
    assert list(ranks[0]) != orders[0]  # another epoch, another order


@pytest.mark.slow  # starts a server or scripts/make_shards.py
def test_training_batches_from_shards_resume_exactly(shards, tmp_path):
    cfg = compose_config(["hardware=cpu", "dataset=shards", f"data.root={shards}", "data.image_size=32",
                          "data.batch_size=16", "data.num_workers=2", "trainer.epochs=2",
                          f"dataset.cache_dir={tmp_path / 'cache'}"])
    whole, rest = whole_and_resumed(cfg, 1, taken=5)
    assert len(whole) == 15 and len(rest) == 10
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(rest, whole[5:], strict=True))


# -- S3: moto's standalone server -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3(shards, tmp_path_factory):
    """An S3-compatible server on 127.0.0.1 with the shards in s3://loadout/shards; yields the env to reach it."""
    boto3 = pytest.importorskip("boto3")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "loadout-test",
           "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        wait_for_port(port, proc)
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=SECRET, region_name="us-east-1")
        client.create_bucket(Bucket="loadout")
        for path in sorted(shards.rglob("*")):
            if path.is_file():
                client.upload_file(str(path), "loadout", f"shards/{path.relative_to(shards)}")
        yield env
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def s3_env(s3, monkeypatch):
    for key, value in s3.items():
        monkeypatch.setenv(key, value)
    return s3


@pytest.mark.slow  # starts a server or scripts/make_shards.py
def test_shards_from_s3_equal_the_local_ones_downloaded_once_into_the_cache(shards, s3_env, tmp_path):
    cache = tmp_path / "cache"
    remote = ShardSource("s3://loadout/shards", "train", cache_dir=str(cache))
    local = ShardSource(str(shards), "train", cache_dir=str(tmp_path / "local-cache"))
    assert len(remote) == len(local) and not list(cache.glob("*.tar")), "lazy: no shard fetched at build"
    assert torch.equal(remote[42][0], local[42][0])
    assert len(list(cache.glob("*.tar"))) == 1, "reading a sample fetched its shard alone"
    assert labels(remote) == labels(local)
    copies = sorted(cache.glob("*.tar"))
    assert len(copies) == len(remote.urls) and not list(cache.glob("*.part"))  # one whole copy per shard


@pytest.mark.slow  # starts a server or scripts/make_shards.py
def test_a_missing_prefix_fails_in_one_line_naming_the_url_never_the_secret(s3_env, tmp_path):
    with pytest.raises(ConfigError) as err:
        ShardSource("s3://loadout/no-such-prefix", "train", cache_dir=str(tmp_path))
    message = str(err.value)
    assert "s3://loadout/no-such-prefix" in message and "\n" not in message and SECRET not in message


@pytest.mark.slow
def test_a_run_trains_from_the_s3_server_and_keeps_the_secret_out_of_its_files(s3, small_run_args, tmp_path):
    result = run_cli([*small_run_args, "dataset=shards", "data.root=s3://loadout/shards", "data.num_workers=2",
                      f"dataset.cache_dir={tmp_path / 'cache'}", "trainer.epochs=1"], env=s3)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_metrics(tmp_path / "run")[-1]["val_samples"] == 80
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".log", ".jsonl", ".json"):
            assert SECRET not in path.read_text(errors="ignore"), path
    assert SECRET not in result.stdout + result.stderr


# -- HTTP: nginx ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def nginx_serving(root: Path, prefix: Path, autoindex: bool = False):
    """nginx serving `root` on 127.0.0.1 (range requests included; folder listings with `autoindex`), its files in
    `prefix`; yields its base URL."""
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if nginx is None:
        pytest.skip("nginx is not installed (`.ci/ensure_package.sh nginx nginx-light` installs it)")
    port = free_port()
    user = "user root;" if os.geteuid() == 0 else ""  # its workers read the test's private tmp dir
    (prefix / "nginx.conf").write_text(f"""daemon off; {user} worker_processes 1; pid {prefix}/nginx.pid;
error_log {prefix}/error.log;
events {{ worker_connections 64; }}
http {{ access_log {prefix}/access.log; client_body_temp_path {prefix}; proxy_temp_path {prefix};
  fastcgi_temp_path {prefix}; uwsgi_temp_path {prefix}; scgi_temp_path {prefix};
  server {{ listen 127.0.0.1:{port}; root {root}; {'autoindex on;' if autoindex else ''} }} }}
""")
    proc = subprocess.Popen([nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf")], stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for_port(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()


@pytest.fixture(scope="module")
def http(shards, tmp_path_factory):
    """nginx serving the shards folder; yields its base URL and its prefix (access.log)."""
    prefix = tmp_path_factory.mktemp("nginx")
    with nginx_serving(shards, prefix) as url:
        yield url, prefix


@pytest.mark.slow  # starts a server or scripts/make_shards.py
def test_shards_over_http_equal_the_local_ones(shards, http, tmp_path):
    url, prefix = http
    remote = ShardSource(url, "train", cache_dir=str(tmp_path / "cache"))
    local = ShardSource(str(shards), "train", cache_dir=str(tmp_path / "local-cache"))
    assert labels(remote) == labels(local) and torch.equal(remote[7][0], local[7][0])
    requests = (prefix / "access.log").read_text().count("GET /train/")
    assert requests == len(remote.urls), "each shard downloaded once"
    again = ShardSource(url, "train", cache_dir=str(tmp_path / "cache"))  # the cache serves a second run
    assert labels(again) == labels(local)
    assert (prefix / "access.log").read_text().count("GET /train/") == requests


@pytest.mark.slow  # starts a server or scripts/make_shards.py
def test_a_shard_that_404s_or_is_missing_fails_at_start_in_one_line_naming_it(shards, http, tmp_path):
    url, _ = http
    with pytest.raises(ShardError) as err:
        ShardStore(tmp_path / "cache").local(f"{url}/train/shard-999999.tar")
    assert str(err.value) == f"shard {url}/train/shard-999999.tar does not exist (FileNotFoundError)"
    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    info = (broken / "_info.json").read_text()
    (broken / "_info.json").write_text(info.replace("shard-000002.tar", "shard-999999.tar"))
    with pytest.raises(ConfigError) as err:
        ShardSource(str(broken), "train", cache_dir=str(tmp_path / "cache"))
    assert "shard-999999.tar" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_shards_that_404_mid_run_are_skipped_and_counted(shards, tmp_path):
    """Shards removed from the web server after the run started (its start-up check passed): their samples are bad
    samples, skipped and counted; the epoch finishes with every other sample."""
    served = tmp_path / "served"
    shutil.copytree(shards, served)
    (tmp_path / "nginx").mkdir()
    with nginx_serving(served, tmp_path / "nginx") as url:
        cfg = compose_config(["hardware=cpu", "dataset=shards", f"data.root={url}", "data.image_size=32",
                              "data.batch_size=16", "data.num_workers=2", "data.drop_last=false",
                              "dataset.prefetch_shards=0", f"dataset.cache_dir={tmp_path / 'cache'}"])
        with data_from_config(cfg, DistEnv(), CPU) as data:
            starts = data.samples[0].shard_starts
            first = int(np.searchsorted(starts, 0, side="right")) - 1  # fetched by the start-up check
            gone = [shard for shard in (3, 5, 8) if shard != first]
            for shard in gone:
                (served / "train" / f"shard-{shard:06d}.tar").unlink()
            data.set_epoch(0)
            batches = list(data.train)
    lost = sum(int(starts[shard + 1] - starts[shard]) for shard in gone)
    assert sum(b.bad for b in batches) == lost and sum(len(b) for b in batches) == 240 - lost


@pytest.mark.slow
def test_a_password_in_an_http_root_reaches_no_log_message_or_run_file(shards, small_run_args, tmp_path):
    """data.root from an environment variable holding http://user:password@host (nginx takes the basic auth header
    and serves), then typed on the command line: the log line naming the root, the trackers' config, Hydra's record of
    the run and a one-line error show it as http://***@."""
    import json

    served = tmp_path / "served"
    shutil.copytree(shards, served)
    info = json.loads((served / "_info.json").read_text())
    for split in info["splits"].values():
        split.pop("shard_lengths")  # so the run indexes every shard at start, saying so with data.root in the line
    (served / "_info.json").write_text(json.dumps(info))
    (tmp_path / "nginx").mkdir()
    with nginx_serving(served, tmp_path / "nginx") as url:
        env = {"SHARDS_URL": url.replace("http://", "http://alice:s3cret@")}
        run = [*small_run_args, "dataset=shards", "data.root=${oc.env:SHARDS_URL}", "trainer.max_steps=2",
               "trainer.epochs=1", "logger=[tensorboard,csv]", f"dataset.cache_dir={tmp_path / 'cache'}"]
        trained = run_cli(run, cwd=tmp_path, env=env)
        assert trained.returncode == 0, trained.stderr[-3000:]
        assert "data.root=http://***@127.0.0.1:" in trained.stdout + trained.stderr
        (served / "train" / "shard-000001.tar").unlink()
        typed = [f"data.root={env['SHARDS_URL']}" if arg.startswith("data.root=") else arg for arg in run]
        failed = run_cli([*typed, f"hydra.run.dir={tmp_path / 'second'}", f"dataset.cache_dir={tmp_path / 'fresh'}"],
                         cwd=tmp_path, env=env)  # the URL typed on the command line this time
    assert failed.returncode == 2
    assert "error: shard http://***@127.0.0.1:" in failed.stderr, failed.stderr[-3000:]
    for result in (trained, failed):
        assert "s3cret" not in result.stdout + result.stderr
    for path in [*(tmp_path / "run").rglob("*"), *(tmp_path / "second").rglob("*")]:
        assert not path.is_file() or b"s3cret" not in path.read_bytes(), path


@pytest.mark.slow
def test_two_ranks_over_uneven_shards_step_alike_and_resume_at_another_worker_count(shards, tmp_path):
    """torchrun, 2 gloo ranks, 240 samples in shards of uneven length and a batch that does not divide them: both
    ranks take the same number of steps (no rank left waiting in an all-reduce), together they see every sample,
    and validation counts each of the 80 samples once. SIGTERM to the agent in epoch 2, then a resume with 2 workers
    a rank instead of 1: each rank trains the batches of the run never stopped."""
    import signal

    from tests.conftest import RECORD_SAMPLES, training_at
    from tests.test_distributed import flat, only_run_dir, samples, torchrun, torchrun_command

    args = ["hardware=cpu", "dataset=shards", f"data.root={shards}", "data.image_size=32", "data.batch_size=14",
            "data.num_workers=1", "trainer.epochs=2", "trainer.progress=false", RECORD_SAMPLES,
            f"dataset.cache_dir={tmp_path / 'cache'}", "data.drop_last=false"]
    (tmp_path / "reference").mkdir()
    result = torchrun(args, tmp_path / "reference")
    assert result.returncode == 0, result.stderr[-3000:]
    reference = only_run_dir(tmp_path / "reference")
    ranks = [samples(reference, 0, rank) for rank in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 9  # 120 samples each: 8 batches of 14 and one of 8
    assert set(flat(ranks[0])) | set(flat(ranks[1])) == set(range(240))
    assert read_metrics(reference)[-1]["val_samples"] == 80

    run_dir = tmp_path / "run"
    agent = subprocess.Popen(torchrun_command([*args, f"hydra.run.dir={run_dir}"]), cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: min(training_at(run_dir, rank) for rank in (0, 1)) >= (1, 2), 300, "epoch 2 to be under way")
    agent.send_signal(signal.SIGTERM)
    out = agent.communicate(timeout=120)[0]
    assert "stopped by SIGTERM at epoch 2" in out, out[-3000:]
    resumed = torchrun([*args, f"hydra.run.dir={run_dir}", "trainer.resume=auto", "data.num_workers=2"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "this loader has 2: resuming from its (epoch, batch) position" in resumed.stdout + resumed.stderr
    for epoch in range(2):
        for rank in (0, 1):
            assert samples(run_dir, epoch, rank) == samples(reference, epoch, rank), (epoch, rank)


# -- Hugging Face parquet --------------------------------------------------------------------------------------
def write_hub_parquet(folder: Path, out: Path) -> Path:
    """The tiny ImageFolder in the Hub's parquet layout: data/<split>-0000i-of-0000n.parquet, an `image` struct of
    bytes and path, a `label`, the ClassLabel names in the huggingface schema metadata; row groups of 50 rows."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    (out / "data").mkdir(parents=True)
    for split, name, files in (("train", "train", 2), ("val", "validation", 1)):
        source = ImageFolderDataset(folder, split)
        features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": source.classes}}
        metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
        rows = np.array_split(np.arange(len(source)), files)
        for number, part in enumerate(rows):
            images = [{"bytes": source.read_encoded(i)[0], "path": f"{i}.jpg"} for i in part.tolist()]
            table = pa.table({"image": images,
                              "label": pa.array(source.targets[part], type=pa.int64())})
            pq.write_table(table.replace_schema_metadata(metadata),
                           out / "data" / f"{name}-{number:05d}-of-{files:05d}.parquet", row_group_size=50)
    return out


def test_a_hub_parquet_dataset_reads_by_row_group_and_trains(tiny_dataset, tmp_path):
    from loadout.data.remote.parquet import ParquetSource

    root = write_hub_parquet(tiny_dataset, tmp_path / "hub")
    source = ParquetSource(str(root), "train", cache_dir=str(tmp_path / "cache"))
    folder = ImageFolderDataset(tiny_dataset, "train")
    assert len(source) == 240 and source.classes == folder.classes and np.array_equal(source.targets, folder.targets)
    assert np.diff(source.shard_starts).tolist() == [50, 50, 20, 50, 50, 20]  # row groups of 50, two files of 120
    assert torch.equal(source[130][0], folder[130][0])
    cfg = compose_config(["hardware=cpu", "dataset=parquet", f"data.root={root}", "data.image_size=32",
                          "data.batch_size=16", "data.num_workers=2", "trainer.epochs=1"])
    with data_from_config(cfg, DistEnv(), CPU) as data:
        data.set_epoch(0)
        seen = [i for batch in data.train for i in batch.indices.tolist()]
        assert sorted(seen) == list(range(240)) and sum(len(b) for b in data.val) == 80


@pytest.mark.slow  # starts a server or scripts/make_shards.py
def test_a_hub_parquet_dataset_from_the_s3_server(tiny_dataset, s3_env, tmp_path):
    import boto3

    from loadout.data.remote.parquet import ParquetSource

    root = write_hub_parquet(tiny_dataset, tmp_path / "hub")
    client = boto3.client("s3")
    for path in sorted((root / "data").iterdir()):
        client.upload_file(str(path), "loadout", f"hub/data/{path.name}")
    remote = ParquetSource("s3://loadout/hub", "val", cache_dir=str(tmp_path / "cache"))
    local = ParquetSource(str(root), "val", cache_dir=str(tmp_path / "local"))
    assert len(remote) == 80 and np.array_equal(remote.targets, local.targets)
    assert not list((tmp_path / "cache").glob("*.parquet")), "footer and labels read in place: no file fetched"
    assert torch.equal(remote[33][0], local[33][0]) and len(list((tmp_path / "cache").glob("*.parquet"))) == 1
    cfg = compose_config(["hardware=cpu", "dataset=parquet", "data.root=s3://loadout/hub", "data.image_size=32",
                          "data.batch_size=16", "data.num_workers=2", "trainer.epochs=1",
                          f"dataset.cache_dir={tmp_path / 'cache'}"])
    with data_from_config(cfg, DistEnv(), CPU) as data:  # trained from the store: every sample, none bad
        data.set_epoch(0)
        batches = list(data.train)
        assert sum(len(b) for b in batches) == 240 and sum(b.bad for b in batches) == 0


@pytest.mark.slow  # starts scripts/make_shards.py
def test_a_truncated_shard_keeps_its_whole_samples_and_a_corrupt_member_is_skipped_and_counted(shards, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(shards, damaged)
    first = damaged / "train" / "shard-000000.tar"
    data = first.read_bytes()
    first.write_bytes(data[:len(data) // 2])  # cut mid-member
    source = ShardSource(str(damaged), "train", cache_dir=str(tmp_path / "cache"))
    lost = int(source.shard_starts[1]) - len(source.members(0)["labels"])
    assert len(source) == 240 and 0 < lost < 7, "the samples before the cut are kept, those after it are gone"
    with pytest.raises(OSError, match="shard-000000.tar holds"):
        source.read_encoded(int(source.shard_starts[1]) - 1)
    second = source.members(1)
    with open(damaged / "train" / "shard-000001.tar", "r+b") as f:  # garbage over one image's bytes
        f.seek(int(second["offsets"][0]))
        f.write(b"\x00" * int(second["sizes"][0]))
    cfg = compose_config(["hardware=cpu", "dataset=shards", f"data.root={damaged}", "data.image_size=32",
                          "data.batch_size=16", "data.num_workers=2", "trainer.epochs=1", "data.drop_last=false",
                          f"dataset.cache_dir={tmp_path / 'cache'}"])
    with data_from_config(cfg, DistEnv(), CPU) as data:
        data.set_epoch(0)
        batches = list(data.train)
    assert sum(b.bad for b in batches) == lost + 1 and sum(len(b) for b in batches) == 240 - lost - 1


@pytest.mark.slow
def test_sigterm_mid_epoch_on_s3_shards_resumes_to_the_uninterrupted_runs_samples_and_weights(s3, tmp_path):
    """The issue's proof: shards from the S3 server, SIGTERM in epoch 2, `trainer.resume=auto`: the same samples
    in the same order and the same final weights as a run never stopped."""
    import signal

    from tests.conftest import RECORD_SAMPLES, epoch_samples, training_at, wait_for
    from tests.test_preemption import assert_same_weights

    def args(run_dir: Path, *extra: str) -> list[str]:
        return ["hardware=cpu", "dataset=shards", "data.root=s3://loadout/shards", "data.image_size=32",
                "data.batch_size=16", "data.num_workers=2", "trainer.epochs=2", "trainer.deterministic=true",
                RECORD_SAMPLES, "trainer.progress=false", f"dataset.cache_dir={tmp_path / 'cache'}",
                f"hydra.run.dir={run_dir}", *extra]

    reference = tmp_path / "reference"
    assert run_cli(args(reference), env=s3).returncode == 0
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "train", *args(run_dir)], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **s3}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: training_at(run_dir) >= (1, 2), 300, "epoch 2 to be under way")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out[-3000:]
    resumed = run_cli(args(run_dir, "trainer.resume=auto"), env=s3)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for epoch in range(2):
        assert epoch_samples(run_dir, epoch, 0) == epoch_samples(reference, epoch, 0), epoch
    assert_same_weights(run_dir, reference)


# -- a far-away or failing store: tests/infra/latency_proxy.py in front of the S3 server --------------------------
def start_proxy(endpoint: str, delay_ms: float) -> tuple[subprocess.Popen, str]:
    """The latency proxy in front of `endpoint`; returns it and its URL (SIGUSR1 stalls it)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "infra" / "latency_proxy.py"), "--to",
                             endpoint.removeprefix("http://"), "--delay-ms", str(delay_ms)],
                            stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline().split()[1])
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture
def far_s3(s3):
    """The S3 server 30 ms a request away; yields (env, proxy process)."""
    proc, url = start_proxy(s3["AWS_ENDPOINT_URL"], 30)
    try:
        yield {**s3, "AWS_ENDPOINT_URL": url}, proc
    finally:
        proc.kill()
        proc.wait()


def cached_shards(cache: Path) -> set[str]:
    return {path.name.split("-", 1)[1] for path in cache.glob("*.tar")} if cache.exists() else set()


@pytest.mark.slow
def test_the_next_shards_are_fetched_ahead_of_the_workers_and_no_further(far_s3, monkeypatch, tmp_path):
    """Cold cache, 30 ms a request: while the first batches are read, a thread of the main process fetches the
    shards the order reaches next (more than the workers have read), but only dataset.prefetch_shards past them."""
    env, _ = far_s3
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cache = tmp_path / "cache"
    cfg = compose_config(["hardware=cpu", "dataset=shards", "data.root=s3://loadout/shards", "data.image_size=32",
                          "data.batch_size=16", "data.num_workers=2", "data.prefetch_factor=1",
                          "dataset.shuffle_window=1", "dataset.prefetch_shards=4", f"dataset.cache_dir={cache}"])
    with data_from_config(cfg, DistEnv(), CPU) as data:
        data.set_epoch(0)
        batches = iter(data.train)
        next(batches)
        starts = data.samples[0].shard_starts
        order = ShardWindowSampler(starts, 1, cfg.trainer.seed, 0, 1).order()
        shard_of = np.searchsorted(starts, order, side="right") - 1
        name = [f"shard-{s:06d}.tar" for s in range(len(starts) - 1)]
        # in the loader by now: at most 2 batches with the workers, 1 ahead on the device, 1 delivered
        read_by_now = {name[s] for s in shard_of[:4 * 16]}
        wait_for(lambda: cached_shards(cache) > read_by_now, 60, "shards past the workers' to be fetched")
        time.sleep(2)  # whatever the thread would fetch beyond its bound has had time to arrive
        reached = len(set(shard_of[:5 * 16].tolist()))
        assert len(cached_shards(cache)) <= reached + 4 + 1 < len(name), "no more than prefetch_shards ahead"
        rest = list(batches)
    assert len(rest) == 14 and sum(b.bad for b in rest) == 0


@pytest.mark.slow
def test_a_store_that_stops_answering_mid_epoch_costs_skipped_samples_not_a_hang(far_s3, small_run_args, tmp_path):
    """The proxy stops moving bytes once the first shard is cached: each stalled download is tried 3 times with
    back-off and fails within data.timeout naming the shard; its samples are skipped and counted, and after one
    such failure a process fails its downloads at once for a while; the run finishes."""
    import signal

    env, proxy = far_s3
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-m", "train", *small_run_args, "dataset=shards",
                             # data.timeout with room for 3 stalled tries on a loaded box (10 s failed under a CPU hog)
                             "data.root=s3://loadout/shards", "data.num_workers=2", "data.timeout=30",
                             "trainer.epochs=1", f"dataset.cache_dir={cache}"], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: cached_shards(cache), 120, "the first shard to be fetched", interval=0.01)
    proxy.send_signal(signal.SIGUSR1)
    stalled = time.monotonic()
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert time.monotonic() - stalled < 150
    assert "cannot download shard s3://loadout/shards/" in out and "after 3 tries" in out, out[-3000:]
    record = read_metrics(tmp_path / "run")[-1]
    assert record["bad_samples"] > 100, record
    skipped_lines = out.count("skipping")
    assert skipped_lines < record["bad_samples"] / 4, "a lost shard is a line per process, not one per sample"
    assert SECRET not in out


@pytest.fixture
def s3_with_keys(shards):
    """An S3 server that checks credentials (moto, IAM enforced after its first requests): the shards uploaded by
    an admin; yields (the trainer's env, a function that revokes the trainer's key)."""
    import json

    boto3 = pytest.importorskip("boto3")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    endpoint = f"http://127.0.0.1:{port}"
    everything = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*",
                                                                     "Resource": "*"}]})

    def user(iam, name: str) -> dict:
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="all", PolicyDocument=everything)
        return iam.create_access_key(UserName=name)["AccessKey"]

    def client(kind: str, key: dict):
        return boto3.client(kind, endpoint_url=endpoint, region_name="us-east-1",
                            aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"])

    try:
        wait_for_port(port, proc)
        admin = user(client("iam", {"AccessKeyId": "bootstrap", "SecretAccessKey": "bootstrap"}), "admin")
        iam = client("iam", admin)
        trainer = user(iam, "trainer")
        store = client("s3", admin)
        store.create_bucket(Bucket="loadout")
        for path in sorted(shards.rglob("*")):
            if path.is_file():
                store.upload_file(str(path), "loadout", f"shards/{path.relative_to(shards)}")
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": trainer["AccessKeyId"],
               "AWS_SECRET_ACCESS_KEY": trainer["SecretAccessKey"], "AWS_DEFAULT_REGION": "us-east-1"}
        yield env, lambda: iam.delete_access_key(UserName="trainer", AccessKeyId=trainer["AccessKeyId"])
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_credential_revoked_mid_epoch_skips_and_counts_and_then_fails_at_start_in_one_line(s3_with_keys,
                                                                                              small_run_args,
                                                                                              tmp_path):
    env, revoke = s3_with_keys
    proxy, url = start_proxy(env["AWS_ENDPOINT_URL"], 100)  # slow enough that most shards are still remote
    args = [*small_run_args, "dataset=shards", "data.root=s3://loadout/shards", "data.num_workers=2",
            "dataset.prefetch_shards=1", "trainer.epochs=1", f"dataset.cache_dir={tmp_path / 'cache'}"]
    try:
        proc = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=tmp_path,
                                env={**os.environ, "PYTHONPATH": str(ROOT), **env, "AWS_ENDPOINT_URL": url},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for(lambda: cached_shards(tmp_path / "cache"), 120, "the first shard to be fetched", interval=0.01)
        revoke()
        out = proc.communicate(timeout=300)[0]
    finally:
        proxy.kill()
        proxy.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "access refused" in out and env["AWS_SECRET_ACCESS_KEY"] not in out, out[-3000:]
    assert read_metrics(tmp_path / "run")[-1]["bad_samples"] > 100
    again = run_cli([*args, f"hydra.run.dir={tmp_path / 'again'}", f"dataset.cache_dir={tmp_path / 'cold'}"],
                    env=env)
    assert again.returncode != 0
    last = again.stderr.strip().splitlines()[-1]
    assert "s3://loadout/shards" in last and env["AWS_SECRET_ACCESS_KEY"] not in again.stderr + again.stdout, last
