"""What keeps a training step sound: precision, out-of-memory recovery (micro-batches), non-finite losses, stop
signals and atomic checkpoints."""
