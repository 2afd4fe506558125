"""The training loop: the step, the epoch, evaluation, checkpoints, signals, and the model and schedule builders."""
