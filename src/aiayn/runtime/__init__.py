"""What every layer may use, below the config: the process's torch settings (torch_settings.py),
its host-memory policy (malloc.py), seeds and RNG states (seeding.py), the start-up line's
timing (startup.py), and durable writes: atomic files, fsync, checksums (durable.py)."""
