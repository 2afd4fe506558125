"""`make tune`'s reusable parts: the sweep's report and profile, the measured CPU precision."""
