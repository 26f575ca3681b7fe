"""What every layer may use, below the config: the process's torch settings (torch_settings.py),
its host-memory policy (malloc.py), seeds and RNG states (seeding.py), the start-up line's
timing (startup.py), durable writes: atomic files, fsync, checksums (durable.py), a manifest's
checksums verified on W ranks, each its share (verify_share.py), safetensors files written by
byte range from the tensors themselves (tensor_files.py), and counts of what a rank does
to storage and to the other ranks at a save and a restart (io_counts.py)."""
