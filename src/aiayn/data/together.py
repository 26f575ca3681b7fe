"""Steps the ranks take together while preparing data (the token cache's build, a Hub split's
copy): each rank's value gathered for all, and an error on one rank raised on every rank."""

from __future__ import annotations

from collections.abc import Callable

from aiayn.errors import AiaynError, DataError

Sync = Callable[[object], list]
"""Every rank calls it with a value and gets every rank's value, in rank order (DistEnv.gather)."""


def on_every_rank(sync: Sync, step: Callable[[], object], doing: str) -> list:
    """Run `step` on every rank and return every rank's result; if it failed on any, raise on
    every rank (a rank that raised alone would leave the others waiting at the next
    collective), naming the first rank that failed and what the ranks were `doing`."""
    try:
        result, error = step(), None
    except AiaynError as exc:
        result, error = None, str(exc)
    outcomes = sync((result, error))
    failed = [(r, e) for r, (_, e) in enumerate(outcomes) if e is not None]
    if failed:
        rank, msg = failed[0]
        raise DataError(msg if len(outcomes) == 1 else f"{doing}, rank {rank}: {msg}")
    return [value for value, _ in outcomes]
