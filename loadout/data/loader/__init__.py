"""DataLoader machinery no user edits: the plan, samplers, the epoch-spanning stream, the shared-memory ring, the
device prefetcher, worker set-up and torchdata's private hooks."""
