"""What grouping a step's units into forwards costs a rank (data/forwards.py), by W and units.

    python benchmarks/fused_forwards.py
    python benchmarks/fused_forwards.py --units 64 4096 --world 8 1024 --budget 3072

Every rank groups every rank's units of the step (so that all know the most forwards any rank
runs) in one pass over the step's units: a row count and a padded width each, no token. This
times that pass for units shaped as the WMT plan makes them (384-token units of widths 12 to
257, rows filling the unit), in a loader's background thread's terms: seconds a step, and
forwards a rank runs. Printed as a table; figures dated in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from aiayn.data.forwards import fuse


def step_units(n: int, unit: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Rows and padded widths of n units of `unit` tokens, of widths as WMT's rows have."""
    width = rng.integers(12, 258, n)
    return np.maximum(1, unit // width), width


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, nargs="+", default=[64, 1024, 4096])
    parser.add_argument("--world", type=int, nargs="+", default=[8, 64, 1024])
    parser.add_argument("--unit", type=int, default=384)
    parser.add_argument("--budget", type=int, default=3072, help="train.max_tokens")
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("| units a step | W | ms a step (one rank) | forwards a rank runs (most) |")
    print("| ---: | ---: | ---: | ---: |")
    for n in args.units:
        rows, width = step_units(n, args.unit, rng)
        units = np.arange(n)
        for world in (w for w in args.world if w <= n):
            owner = units % world
            start = time.perf_counter()
            for _ in range(args.repeat):
                counts, _ = fuse(units, owner, rows, width, args.budget, 0)
            ms = (time.perf_counter() - start) / args.repeat * 1e3
            print(f"| {n:,} | {world:,} | {ms:.2f} | {max(counts.values())} |")


if __name__ == "__main__":
    main()
