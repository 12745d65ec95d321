"""posterior-bench: runners and plumbing (data, models, checkpoint store, stages, CLI)."""
