"""Running plans: the checkpoint store and what it needs."""
