"""How a config's values are checked: the ranges declared with the fields, the Section base
whose `validate` adds the checks that involve several fields, and the nearest known name that
an error suggests."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts, declared with it (`bounded`) and checked at load."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is refused
    high_open: bool = False

    def admits(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        if not (self.low_open or self.high_open):
            return f"{self.low}..{self.high}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{self.low}, {self.high}{right}"


def bounded(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    wrong_type: str | None = None,
    **bounds,
) -> Any:
    """A dataclass field whose value must lie in Range(**bounds); None always passes.
    `wrong_type` is added to the error for a value of the wrong type: what the user likely
    meant."""
    metadata = {"range": Range(**bounds), "wrong_type": wrong_type}
    return field(default=default, default_factory=default_factory, metadata=metadata)


class Section:
    """A config section. Field ranges are declared with the fields (`bounded`) and checked for
    every section at once; `validate` adds the checks that involve several fields."""

    def validate(self) -> list[str]:
        return []


def range_errors(section: Any, name: str) -> list[str]:
    """Every declared bound `section` (the config section called `name`) breaks."""
    errs = []
    for f in dataclasses.fields(section):
        bound, value = f.metadata.get("range"), getattr(section, f.name)
        if bound is None or value is None:
            continue
        values = value if isinstance(value, list) else [value]
        if not all(bound.admits(v) for v in values):
            errs.append(f"{name}.{f.name} must be {str(bound)}, got {value}")
    return errs


def suggest(name: str, known, prefix: str = "") -> str:
    """The "; did you mean X?" an error ends with: X the name in `known` nearest to `name`
    (after `prefix`), or nothing if none is near."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.5)
    return f"; did you mean {prefix}{close[0]}?" if close else ""
