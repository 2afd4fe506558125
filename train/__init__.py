"""loadout: a PyTorch training template whose point is keeping the GPU fed.

Where to look (a forker's reading list first):
- task/     what is learned: the loss, the evaluation sums and figures, which epoch is best (base.py: your own)
- loop/     the step (step.py), evaluation (evaluate.py), the epoch loop (engine.py), the ranks' agreement to stop
            (agreement.py), checkpoints and resume, the model and schedule builders
- data/     the dataset interface (source.py), loadout's sources (datasets, voc, mix), the per-sample path
            (samples.py), augmentation (augment, seg_augment, transforms, geometry); its back rooms need no edits:
            loader/ (DataLoader machinery, stage clocks, autotune), remote/ (shards, parquet, object stores),
            fast/ (scaled, crop-aware and device decode, the sample cache, the packed format), files/ (HDF5, LMDB)
- observe/  the one metric vocabulary, the epoch meter, the doctor's diagnosis, memory, Prometheus and trackers
- run/      the harness around a run: the job and its exit statuses, the command line, resume replay, run dirs
- config.py the schema, composed from each section's own (data/config.py, loop/config.py); errors.py, dist.py,
            device.py, build.py and credentials.py are the floor every wing stands on
"""
