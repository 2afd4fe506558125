"""loadout: a PyTorch training template whose point is keeping the GPU fed.

Where to look (a forker's reading list first):
- loop/     the step (loss, backward, optimizer), the epoch loop, checkpoints, the model and schedule builders
- data/     the dataset interface (source.py), loadout's sources, the per-sample path (samples.py), augmentation;
            its back rooms need no edits: loader/ (DataLoader machinery), remote/ (shards, parquet, object stores),
            fast/ (device and scaled decode, the sample cache, the packed format)
- observe/  the one metric vocabulary, the log line, memory, Prometheus and the experiment trackers
- run/      the harness around a run: the command line, resume replay, run dirs, locks, lost peers, exit statuses
- config.py the typed schema; errors, dist, device and build are the ground floor every wing stands on
"""
