"""`python -m aiayn ...` is the console script; torchrun and srun launch it this way."""

from aiayn.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
