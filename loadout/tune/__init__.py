"""`make tune`'s reusable parts: timing a data path, the sweep's report and profile, the measured CPU precision."""
