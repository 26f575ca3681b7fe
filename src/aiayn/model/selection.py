"""Parameters named by globs in a config (init.exclude, train.freeze): each glob must name at
least one parameter, so that a typo is an error, not a setting that silently does nothing."""

from __future__ import annotations

import fnmatch

from torch import nn

from aiayn.errors import ConfigError


def names_by_parameter(model: nn.Module) -> dict[int, list[str]]:
    """Every parameter (by id) with all its names: a tied matrix has several."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def matching(model: nn.Module, globs: list[str], key: str) -> dict[int, list[str]]:
    """The parameters (by id) that any glob of `key` names, with all their names (a tied matrix
    has several). ConfigError for a glob that names none, showing how names look."""
    names = names_by_parameter(model)
    every = [n for group in names.values() for n in group]
    unmatched = [g for g in globs if not fnmatch.filter(every, g)]
    if unmatched:
        shown = ", ".join(every[:4] + ["..."] + every[-2:]) if len(every) > 6 else ", ".join(every)
        raise ConfigError(
            f"{key}: {', '.join(map(repr, unmatched))} names no parameter of this model: "
            f"fnmatch globs over its parameter names, which are such as {shown}"
        )
    return {
        pid: group
        for pid, group in names.items()
        if any(fnmatch.fnmatch(n, g) for n in group for g in globs)
    }


def freeze(model: nn.Module, globs: list[str]) -> int:
    """train.freeze: the matched parameters get no gradient (the engines hand only trainable
    ones to their optimizer). Returns how many values were frozen."""
    if not globs:
        return 0
    chosen = matching(model, globs, "train.freeze")
    frozen = 0
    for param in model.parameters():
        if id(param) in chosen:
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen
