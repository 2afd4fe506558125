"""The harness around one run: command line, resume replay, run dir and lock, lost peers, exit statuses."""
