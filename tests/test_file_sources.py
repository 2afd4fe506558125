"""What dataset=hdf5 and dataset=lmdb share: they resume as any source does (a run stopped mid-epoch at one world size
and worker count and resumed at another trains the rest of the epoch, each sample once, then epochs as a fresh run
would), and without their library a run names the extra that installs it."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from tests.test_hdf5 import write_encoded
from tests.test_world_size_resume import ROOT, TRAIN, resume, stop, stream, take


@pytest.fixture(scope="module")
def stores(tiny_dataset, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("stores")
    write_encoded(out / "set.h5", tiny_dataset)
    subprocess.run([sys.executable, "scripts/convert_dataset.py", str(tiny_dataset), str(out / "lmdb"), "--to",
                    "lmdb"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    return {"hdf5": out / "set.h5", "lmdb": out / "lmdb"}


@pytest.mark.parametrize(("kind", "before", "after"), [("hdf5", 2, 1), ("lmdb", 1, 2)])
def test_resumed_at_another_world_size_and_worker_count_each_sample_once(stores, kind, before, after):
    root = stores[kind]
    first, state = stop([stream(root, r, before, f"dataset={kind}") for r in range(before)], 0, 3)
    streams, _ = resume(root, after, state, f"dataset={kind}", "data.num_workers=2")
    rests = [take(train, 0) for train in streams]
    counts = Counter(first + [i for rest in rests for i in rest])
    assert set(counts) == set(range(TRAIN)) and set(counts.values()) == {1}
    fresh = [stream(root, r, after, f"dataset={kind}") for r in range(after)]
    assert [take(train, 1) for train in streams] == [take(train, 1) for train in fresh]


@pytest.mark.parametrize(("module", "target", "extra"), [
    ("h5py", "loadout.data.files.hdf5_source import hdf5_source as source", "hdf5"),
    ("lmdb", "loadout.data.files.lmdb_source import LMDBSource as source", "lmdb"),
    ("msgpack", "loadout.data.files.lmdb_source import LMDBSource as source", "lmdb")])
def test_without_its_library_the_run_names_the_extra(tmp_path, module, target, extra):
    code = f"import sys; sys.modules[{module!r}] = None\nfrom {target}\nsource({str(tmp_path)!r})"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert f"dataset={extra}: needs {module}" in run.stderr.splitlines()[-1]
    assert f"pip install 'loadout[{extra}]'" in run.stderr.splitlines()[-1]
