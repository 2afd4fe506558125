#!/usr/bin/env python3
"""Tar shards vs the same images as an ImageFolder: images/s of loadout's loader, data only, 2 workers, the same
settings (target >= 0.95): the map-style index makes a shard sample a seek and a read, so sharding costs nothing.
Also for reference: the same shards served by an S3-compatible server (moto's, on this machine) once they are in the
node's cache (warm)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, SEED_DATA, interleaved, machine, pipeline, report, steady_images_per_s

SETTINGS = ("data.num_workers=2", "trainer.epochs=3", "data.batch_size=64", "data.image_size=224",
            "data.resize_size=256")


def rate(root: Path | str, *overrides: str) -> float:
    return steady_images_per_s(pipeline(*SETTINGS, *overrides, root=root))


def s3_copy(shards: Path):
    """moto's S3 server on a free port with the shards uploaded; returns (process, env) or None without boto3."""
    try:
        import boto3
    except ImportError:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="bench",
                          aws_secret_access_key="bench", region_name="us-east-1")
    client.create_bucket(Bucket="bench")
    for path in sorted(shards.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), "bench", f"shards/{path.relative_to(shards)}")
    return server, env


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        shards, cache = Path(tmp) / "shards", Path(tmp) / "cache"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_shards.py"), str(SEED_DATA), str(shards),
                        "--shard-bytes", str(8 << 20)], check=True, capture_output=True)
        sharded = ("dataset=shards", f"data.shard_cache_dir={cache}")
        local, folder = interleaved(lambda: rate(shards, *sharded), lambda: rate(SEED_DATA), rounds=3)
        report("local shards / ImageFolder img/s", local / folder, ">= 0.95", local / folder >= 0.95,
               f"{local:.0f} vs {folder:.0f} img/s, 320 px JPEGs -> 224, 2 workers, batch 64; {machine()}")
        served = s3_copy(shards)
        if served is not None:
            server, env = served
            os.environ.update(env)
            try:
                rate("s3://bench/shards", *sharded)  # cold: every shard into the node's cache
                warm = rate("s3://bench/shards", *sharded)
            finally:
                server.kill()
            print(f"  S3-compatible server, warm cache / local shards: {warm / local:.2f} ({warm:.0f} img/s)")
