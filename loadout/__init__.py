"""loadout: the loader and run machinery of the training template in train/, importable on its own.

- data/     sources (ImageFolder, VOC, mixes, tar shards, parquet, HDF5, LMDB, packed), the per-sample path, the
            loader (plan, shared-memory batch ring, stage clocks, autotune, exact positions) and the device prefetcher
- observe/  the metric vocabulary, the epoch meter, the doctor's diagnosis, memory, Prometheus and trackers
- runtime/  precision, out-of-memory recovery, non-finite losses, stop signals, atomic checkpoints
- run/      the harness around a run: resume replay, run dirs and their lock, the run record, lost peers
- tune/     `make tune`'s engine: the sweep's schema and check, each job's record and timing, the report and
            profile (callback.py), the measured CPU precision
- errors.py, dist.py, device.py, build.py, credentials.py: the floor the rest stands on

loadout never imports train/ (tests/test_layering.py holds the rule): the template hands in its parts.

The public names (`__all__`, docs/library.md says what each is and what a version bump promises) are reached as
`loadout.<name>`: each is imported on first use, so `import loadout` (and every `import loadout.<module>`, which
runs this file first) stays free of torch, and no module of the package imports through this file.
"""

from __future__ import annotations

from importlib import import_module

# name -> (module, attribute there): docs/library.md documents each, in this order
_PUBLIC = {
    # the data path: settings -> plan -> two loaders -> named batches on the device, with exact positions
    "DataConfig": ("loadout.data.config", "DataConfig"),
    "LoaderPlan": ("loadout.data.loader.plan", "LoaderPlan"),
    "Source": ("loadout.data.source", "Source"),
    "ImageFolderDataset": ("loadout.data.datasets", "ImageFolderDataset"),
    "build_sources": ("loadout.data.pipeline", "build_sources"),
    "build_data": ("loadout.data.pipeline", "build_data"),
    "DataPipeline": ("loadout.data.pipeline", "DataPipeline"),
    "Batch": ("loadout.data.loader.batch", "Batch"),
    # observation: the epoch's figures and the doctor that names what bounds it
    "EpochMeter": ("loadout.observe.meter", "EpochMeter"),
    "Doctor": ("loadout.observe.doctor", "Doctor"),
    "Machine": ("loadout.observe.doctor", "Machine"),
    "Metric": ("loadout.observe.metrics", "Metric"),
    # the run's machinery
    "save_checkpoint": ("loadout.runtime.checkpoint", "save"),
    "load_checkpoint": ("loadout.runtime.checkpoint", "load"),
    "StopSignal": ("loadout.runtime.stop", "StopSignal"),
    "NonFiniteWatch": ("loadout.runtime.nonfinite", "NonFiniteWatch"),
    # the floor
    "DistEnv": ("loadout.dist_env", "DistEnv"),
    "select_device": ("loadout.device", "select_device"),
    "seed_everything": ("loadout.dist", "seed_everything"),
    "Failure": ("loadout.errors", "Failure"),
    "ConfigError": ("loadout.errors", "ConfigError"),
}

__all__ = ["__version__", *_PUBLIC]


def _version() -> str:
    """This copy's version: a checkout's own pyproject.toml first (the metadata of an editable install is written at
    install time and goes stale as the checkout moves on), else the installed distribution's metadata."""
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") == "loadout" and "version" in project:
            return project["version"]
    try:
        return version("loadout")
    except PackageNotFoundError:
        return "0+unknown"  # a copy of the sources with neither: PEP 440's local version, below any release


def __getattr__(name: str):
    if name == "__version__":
        value = _version()
    elif name in _PUBLIC:
        module, attribute = _PUBLIC[name]
        value = getattr(import_module(module), attribute)
    else:
        raise AttributeError(f"module 'loadout' has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
