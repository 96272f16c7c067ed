"""A run's files on disk: its directory and status, the index the lab lists, liveness, the end-of-run summary."""
