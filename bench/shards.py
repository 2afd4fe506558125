#!/usr/bin/env python3
"""Sharded data against the same images elsewhere: images/s of loadout's loader, data only, 2 workers.

1. Local tar shards / the same images as an ImageFolder, steady epochs (target >= 0.95): the map-style index makes a
   shard sample a seek and a read, so sharding costs nothing.
2. Shards in an S3-compatible server (moto's) 30 ms a request away (tests/infra/latency_proxy.py) / the same shards
   on the local disk, a first epoch from a fresh pipeline each: with a cold node cache (target >= 0.9: the
   fetch-ahead threads hide the latency) and with a warm one (target >= 0.95). The server and the proxy run on this
   machine, so their CPU time comes out of the workers' cores: the bench prints their share of the machine, and the
   cold epoch 30 ms away / the same cold epoch through a proxy that adds nothing, which is the latency's own cost.
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
COPIES = 16  # the seed set's shards listed this many times: an epoch the first batch's wait is a small part of


def rate(root: Path | str, *overrides: str) -> float:
    return steady_images_per_s(pipeline(*SETTINGS, "trainer.epochs=3", *overrides, root=root))


def cold_epoch_rate(root: Path | str, cache: Path, *overrides: str) -> float:
    """Images/s over one epoch of a fresh pipeline whose node cache is `cache`."""
    with pipeline(*SETTINGS, "trainer.epochs=1", "dataset=shards", f"dataset.cache_dir={cache}", *overrides,
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
    if "labels_per_shard" in train:
        info["splits"]["train"]["labels_per_shard"] = train["labels_per_shard"] * COPIES
    (out / "_info.json").write_text(json.dumps(info))
    return out


def serve(shards: Path):
    """moto's S3 server with the shards in s3://bench/shards, behind a 30 ms proxy and a 0 ms one; returns
    (processes, credentials, {delay in ms: endpoint URL})."""
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
    processes, endpoints = [server], {}
    for delay in (30, 0):
        proxy = subprocess.Popen([sys.executable, str(ROOT / "tests" / "infra" / "latency_proxy.py"), "--to",
                                  f"127.0.0.1:{port}", "--delay-ms", str(delay)], stdout=subprocess.PIPE, text=True)
        processes.append(proxy)
        endpoints[delay] = f"http://127.0.0.1:{proxy.stdout.readline().split()[1]}"
    return processes, keys, endpoints


def own_cpu(into: list[float], epoch):
    """`epoch()`, adding to `into` the CPU seconds this process (the loader's main process: fetch-ahead threads,
    batches in) spent on it."""
    before = os.times()
    value = epoch()
    after = os.times()
    into.append(after.user + after.system - before.user - before.system)
    return value


def cpu_seconds(processes) -> float:
    """User + system CPU time the processes have used so far."""
    total = 0.0
    for process in processes:
        fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards, cache = tmp / "shards", tmp / "cache"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_shards.py"), str(SEED_DATA), str(shards),
                        "--shard-bytes", str(4 << 20)], check=True, capture_output=True)
        sharded = ("dataset=shards", f"dataset.cache_dir={cache}")
        local, folder = interleaved(lambda: rate(shards, *sharded), lambda: rate(SEED_DATA), rounds=5)
        report("local shards / ImageFolder img/s", local / folder, ">= 0.95", local / folder >= 0.95,
               f"{local:.0f} vs {folder:.0f} img/s, 320 px JPEGs -> 224, 2 workers, batch 64; {machine()}")

        many = longer(shards, tmp / "many")
        processes, keys, endpoints = serve(many)
        os.environ.update(keys)
        caches = iter(range(100))
        stand_ins: list[float] = []  # the server's and the proxies' share of the machine in each cold epoch
        client_s: dict[str, list[float]] = {"s3": [], "local": []}  # the main process's CPU s per cold epoch

        def from_s3(delay: int, cache: Path, *overrides: str) -> float:
            os.environ["AWS_ENDPOINT_URL"] = endpoints[delay]
            before, start = cpu_seconds(processes), time.perf_counter()
            rate = cold_epoch_rate("s3://bench/shards", cache, *overrides)
            stand_ins.append((cpu_seconds(processes) - before) / (time.perf_counter() - start) / len(
                os.sched_getaffinity(0)))
            return rate

        def from_disk() -> float:
            return cold_epoch_rate(many, tmp / f"local{next(caches)}")

        try:
            rounds = {"far": [], "near": [], "local": []}
            for _ in range(3):  # cold 30 ms away, cold 0 ms away, local: interleaved
                rounds["far"].append(own_cpu(client_s["s3"], lambda: from_s3(30, tmp / f"cold{next(caches)}")))
                rounds["near"].append(from_s3(0, tmp / f"cold{next(caches)}"))
                rounds["local"].append(own_cpu(client_s["local"], from_disk))
            share = max(stand_ins)
            client_ms = {where: min(seconds) * 1000 for where, seconds in client_s.items()}
            cold_rate, near_rate, local_rate = (max(rates) for rates in rounds.values())
            unhidden = from_s3(30, tmp / "unhidden", "dataset.prefetch_shards=0")
            from_s3(30, tmp / "warm")  # fills the warm cache
            warm_rate, local_again = interleaved(lambda: from_s3(30, tmp / "warm"), from_disk, rounds=3)
        finally:
            for process in processes:
                process.send_signal(signal.SIGKILL)
        images = sum(json.loads((many / "_info.json").read_text())["splits"]["train"]["shard_lengths"])
        tars = list((many / "train").glob("*.tar"))
        mib = sum(t.stat().st_size for t in tars) / len(tars) / 2**20
        report("S3 30 ms away, cold cache / local shards img/s", cold_rate / local_rate, ">= 0.9",
               cold_rate / local_rate >= 0.9, f"{cold_rate:.0f} vs {local_rate:.0f} img/s, first epoch of "
               f"{images} images in {len(tars)} shards of {mib:.1f} MiB; the server and proxy on this machine took "
               f"up to {share:.0%} of its CPU")
        print(f"  the loader's main process, CPU per shard in a cold epoch: {client_ms['s3'] / len(tars):.1f} ms from "
              f"S3 (download, cache file, index) vs {client_ms['local'] / len(tars):.1f} ms from the local disk")
        print(f"  cold 30 ms away / cold 0 ms away (the latency's own cost): {cold_rate / near_rate:.2f} "
              f"({near_rate:.0f} img/s 0 ms away)")
        print(f"  without fetching ahead (dataset.prefetch_shards=0), cold 30 ms away / local: "
              f"{unhidden / local_rate:.2f} ({unhidden:.0f} img/s)")
        report("S3 30 ms away, warm cache / local shards img/s", warm_rate / local_again, ">= 0.95",
               warm_rate / local_again >= 0.95, f"{warm_rate:.0f} vs {local_again:.0f} img/s; {machine()}")
