#!/usr/bin/env python3
"""Sharded data against the same images elsewhere: images/s of loadout's loader, data only, 2 workers.

1. Local tar shards / the same images as an ImageFolder, steady epochs (target >= 0.95): the map-style index makes a
   shard sample a seek and a read, so sharding costs nothing.
2. Shards in an S3-compatible server (moto's) 30 ms a request away (tests/infra/latency_proxy.py) / the same shards
   on the local disk, a first epoch from a fresh pipeline each: with a cold node cache (target >= 0.9: the
   fetch-ahead thread hides the latency) and with a warm one (target >= 0.95). The server and the proxy run on this
   machine, so their CPU time comes out of the workers' cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (
    ROOT,
    SEED_DATA,
    host_batches,
    images_per_s,
    interleaved,
    machine,
    pipeline,
    report,
    steady_images_per_s,
)

SETTINGS = ("data.num_workers=2", "data.batch_size=64", "data.image_size=224", "data.resize_size=256")
COPIES = 8  # the seed set's shards listed this many times: an epoch long enough to time a cold cache


def rate(root: Path | str, *overrides: str) -> float:
    return steady_images_per_s(pipeline(*SETTINGS, "trainer.epochs=3", *overrides, root=root))


def first_epoch(root: Path | str, cache: Path, *overrides: str) -> float:
    """Images/s over one epoch of a fresh pipeline whose node cache is `cache`."""
    with pipeline(*SETTINGS, "trainer.epochs=1", "dataset=shards", f"data.shard_cache_dir={cache}", *overrides,
                  root=root) as data:
        return images_per_s(host_batches(data, 0))


def longer(shards: Path, out: Path) -> Path:
    """`shards` with its training shards listed COPIES times (hard links under new names) in an _info.json."""
    info = json.loads((shards / "_info.json").read_text())
    train = info["splits"]["train"]
    names, lengths = [], []
    for copy in range(COPIES):
        for name, length in zip(train["filenames"], train["shard_lengths"], strict=True):
            target = out / f"train/copy{copy}-{Path(name).name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(shards / name, target)
            names.append(str(target.relative_to(out)))
            lengths.append(length)
    shutil.copytree(shards / "val", out / "val")
    info["splits"]["train"] = {**train, "filenames": names, "shard_lengths": lengths, "num_samples": sum(lengths)}
    (out / "_info.json").write_text(json.dumps(info))
    return out


def serve(shards: Path):
    """moto's S3 server with the shards in s3://bench/shards, behind the 30 ms proxy; returns (processes, env)."""
    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    keys = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="bench",
                          aws_secret_access_key="bench", region_name="us-east-1")
    client.create_bucket(Bucket="bench")
    for path in sorted(shards.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), "bench", f"shards/{path.relative_to(shards)}")
    proxy = subprocess.Popen([sys.executable, str(ROOT / "tests" / "infra" / "latency_proxy.py"), "--to",
                              f"127.0.0.1:{port}", "--delay-ms", "30"], stdout=subprocess.PIPE, text=True)
    proxy_port = int(proxy.stdout.readline().split()[1])
    return (server, proxy), {**keys, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy_port}"}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards, cache = tmp / "shards", tmp / "cache"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_shards.py"), str(SEED_DATA), str(shards),
                        "--shard-bytes", str(4 << 20)], check=True, capture_output=True)
        sharded = ("dataset=shards", f"data.shard_cache_dir={cache}")
        local, folder = interleaved(lambda: rate(shards, *sharded), lambda: rate(SEED_DATA), rounds=3)
        report("local shards / ImageFolder img/s", local / folder, ">= 0.95", local / folder >= 0.95,
               f"{local:.0f} vs {folder:.0f} img/s, 320 px JPEGs -> 224, 2 workers, batch 64; {machine()}")

        many = longer(shards, tmp / "many")
        processes, env = serve(many)
        os.environ.update(env)
        caches = iter(range(100))
        try:
            def cold() -> float:
                return first_epoch("s3://bench/shards", tmp / f"cold{next(caches)}")

            def local_first() -> float:
                return first_epoch(many, tmp / f"local{next(caches)}")

            cold_rate, local_rate = interleaved(cold, local_first, rounds=3)
            unhidden = first_epoch("s3://bench/shards", tmp / "unhidden", "data.prefetch_shards=0")
            first_epoch("s3://bench/shards", tmp / "warm")  # fills the warm cache
            warm_rate, local_again = interleaved(lambda: first_epoch("s3://bench/shards", tmp / "warm"),
                                                 local_first, rounds=3)
        finally:
            for process in processes:
                process.send_signal(signal.SIGKILL)
        images = sum(json.loads((many / "_info.json").read_text())["splits"]["train"]["shard_lengths"])
        tars = list((many / "train").glob("*.tar"))
        mib = sum(t.stat().st_size for t in tars) / len(tars) / 2**20
        report("S3 30 ms away, cold cache / local shards img/s", cold_rate / local_rate, ">= 0.9",
               cold_rate / local_rate >= 0.9, f"{cold_rate:.0f} vs {local_rate:.0f} img/s, first epoch of "
               f"{images} images in {len(tars)} shards of {mib:.1f} MiB")
        print(f"  without fetching ahead (data.prefetch_shards=0), cold: {unhidden / local_rate:.2f} "
              f"({unhidden:.0f} img/s)")
        report("S3 30 ms away, warm cache / local shards img/s", warm_rate / local_again, ">= 0.95",
               warm_rate / local_again >= 0.95, f"{warm_rate:.0f} vs {local_again:.0f} img/s; {machine()}")
