"""The data path (pipeline.py): source -> Samples (seed, note, load/cache, transform, skip bad) -> sampler ->
DataLoader (every knob, one LoaderPlan) -> device prefetcher -> Batch on the device.

The training loop sees only `DataPipeline`: `train` and `val` both yield `Batch`es on the device through the same
prefetcher. `train` is a `TrainStream` (stream.py): one loader iterator spanning all epochs, so the workers
prefetch across epoch boundaries, with a state a checkpoint keeps; `positions(env)` gathers every rank's for it.

`import loadout.data.config` (the `data:` schema, which the command line checks before torch loads) must stay light,
so this file imports nothing: `loadout.data.build_data` and the pipeline's other names are looked up on first use.
"""

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a type checker sees; at run time __getattr__ below
    from loadout.data.pipeline import DataPipeline, LoaderRecipe, build_data, build_sources

__all__ = ["DataPipeline", "LoaderRecipe", "build_data", "build_sources"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(import_module("loadout.data.pipeline"), name)
    raise AttributeError(f"module 'loadout.data' has no attribute {name!r}")
