"""What a run reports: the metric vocabulary, the log line, memory, Prometheus and the experiment trackers."""
