"""What a loader saves: a version, a fingerprint of what the position means (data, batching,
tokenizer), and the position itself; and the checks before a saved one is used. Also the
settings every row source is made with (`Settings`)."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

from aiayn.config import DataConfig
from aiayn.errors import DataError
from aiayn.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_LOADER_NAMES = {"stream": "streaming loader's (data.cache=false)", "cache": "token cache's"}
_LOADER_FIX = {"stream": "data.cache=false", "cache": "data.cache=true"}


@dataclass(frozen=True)
class Settings:
    """What the batches of a split depend on, besides its rows: the data config, the
    tokenizer, the model kind, the token budget, the seed, and whether it trains (epoch after
    epoch, shuffled) or makes one pass. `rank` says which rank logs."""

    cfg: DataConfig
    tok: Tokenizer
    kind: str
    max_tokens: int  # the plan's budget: train.unit_tokens or max_tokens when training
    seed: int
    train: bool
    rank: int = 0

    @property
    def multiple(self) -> int:
        """What batch widths are rounded up to (data.pad_to_multiple; 1 where unset)."""
        return self.cfg.pad_to_multiple or 1


def check_loader_args(max_tokens: int, rank: int, world_size: int) -> None:
    if max_tokens < 1:
        raise DataError(f"max_tokens must be >= 1, got {max_tokens}; set train.max_tokens")
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside world size {world_size}")


def fingerprint(s: Settings, name: str, data: dict) -> dict:
    """What a saved position means: the row source `name` ("cache" or "stream"), `data` (what
    names the data: a cache's digest, a stream's corpus, a mixture), and every setting that
    changes the batches. A position resumes only where all are equal."""
    out = {
        "loader": name,
        **data,
        "kind": s.kind,
        "train": s.train,
        "max_tokens": s.max_tokens,
        "seed": s.seed,
        "shuffle_buffer": s.cfg.shuffle_buffer,
        "max_len": s.cfg.max_len,
        "pad_to_multiple": s.multiple,
        "tokenizer_sha256": s.tok.sha256,
    }
    if s.kind == "lm":
        out["lm_order"] = s.cfg.lm_order
    return out


def saved_state(version: int, fingerprint: dict, position: dict) -> dict:
    """Plain ints, strings, lists and dicts: safe for torch.load(weights_only=True)."""
    return {
        "version": version,
        "fingerprint": dict(fingerprint),
        "position": copy.deepcopy(position),
    }


def saved_position(state: dict, version: int, fingerprint: dict, what: str) -> dict:
    """The position in `state`, if it was saved by this loader for these settings; else a
    DataError naming what differs and how to fix it."""
    saved = state.get("fingerprint", {})
    wrote, reads = saved.get("loader"), fingerprint.get("loader")
    if wrote != reads and wrote in _LOADER_NAMES:
        raise DataError(
            f"the saved data position is the {_LOADER_NAMES[wrote]}: resume with "
            f"{_LOADER_FIX[wrote]}, or train in a new run_dir"
        )
    if state.get("version") != version:
        raise DataError(
            f"data position has version {state.get('version')}, this code reads {version}; "
            "resume with the aiayn version that wrote the checkpoint"
        )
    diffs = _mixture_diffs(saved.get("mixture"), fingerprint.get("mixture"))
    for key, value in fingerprint.items():
        if key in ("mixture", "cache") and ("mixture" in saved or "mixture" in fingerprint):
            continue  # what the data is: said by _mixture_diffs
        if key == "source":
            diffs += _source_diffs(saved.get(key, {}), value)
        elif key == "max_tokens" and saved.get(key) != value:  # the plan's unit
            diffs.append(
                f"  - the batch plan's unit (train.unit_tokens, else train.max_tokens): "
                f"checkpoint {saved.get(key)!r}, now {value!r}; to resume with forwards of "
                f"another max_tokens (at least the unit), keep the plan: "
                f"train.unit_tokens={saved.get(key)}"
            )
        elif saved.get(key) != value:
            diffs.append(f"  - {key}: checkpoint {saved.get(key)!r}, now {value!r}")
    if diffs:
        raise DataError(
            f"the saved data position does not fit this loader of {what}:\n"
            + "\n".join(diffs)
            + "\nThe position is only meaningful for the same data, batching and tokenizer: "
            "restore those settings, or train in a new run_dir."
        )
    return copy.deepcopy(state["position"])


def _source_diffs(saved: dict, now: dict) -> list[str]:
    """What changed in the corpus a streaming position counts records of (source_identity):
    its files, their sizes, and their first and last MiB where both sides recorded them. A new
    modification time with both ends unchanged (a copy, `touch`) is said, not refused."""
    diffs = []
    for key, what in (("fields", "fields read"), ("hub", "hub dataset")):
        if saved.get(key) != now.get(key):
            diffs.append(f"  - {what}: checkpoint {saved.get(key)!r}, now {now.get(key)!r}")
    old, new = saved.get("files", []), now.get("files", [])
    if [f["path"] for f in old] != [f["path"] for f in new]:
        paths = [f["path"] for f in old], [f["path"] for f in new]
        diffs.append("  - files: checkpoint {}, now {}".format(*paths))
        return diffs
    for a, b in zip(old, new, strict=True):
        if a["bytes"] != b["bytes"]:
            diffs.append(f"  - {b['path']}: checkpoint {a['bytes']} bytes, now {b['bytes']} bytes")
            continue
        ends = [
            where
            for key, where in (("head_sha256", "first"), ("tail_sha256", "last"))
            if key in a and key in b and a[key] != b[key]
        ]
        if ends:
            diffs.append(
                f"  - {b['path']}: edited in place since the checkpoint (the same "
                f"{b['bytes']} bytes, its {' and '.join(ends)} MiB changed), so the saved "
                "position counts records of other text: restore the file, or train in a new "
                "run_dir"
            )
        elif a.get("mtime_ns", b.get("mtime_ns")) != b.get("mtime_ns"):
            log.warning(
                "%s was modified since the checkpoint, at the same size and with the same first "
                "and last MiB: resuming its position. An edit between them would not be seen: "
                "if the text changed, train in a new run_dir",
                b["path"],
            )
    return diffs


def _mixture_diffs(saved: dict | None, now: dict | None) -> list[str]:
    """What changed in a mixture (data.sources), by source: one line per change."""
    if saved is None and now is None:
        return []
    if saved is None or now is None:
        was, is_ = ("data.train", "data.sources") if now else ("data.sources", "data.train")
        return [f"  - data: the checkpoint trained on {was}, this config names {is_}"]
    old = {s["name"]: s for s in saved["sources"]}
    new = {s["name"]: s for s in now["sources"]}
    diffs = [f"  - source {n}: not in the checkpoint's mixture" for n in new if n not in old]
    diffs += [f"  - source {n}: in the checkpoint's mixture, not now" for n in old if n not in new]
    for name in (n for n in new if n in old):
        a, b = old[name], new[name]
        if a.get("cache") != b.get("cache"):  # the token cache's content
            diffs.append(f"  - source {name}: its tokens changed (corpus, fields or tokenizer)")
        if a.get("source") is not None and b.get("source") is not None:  # a stream's corpus
            diffs += [f"  - source {name}:{d[3:]}" for d in _source_diffs(a["source"], b["source"])]
        elif a.get("source") != b.get("source"):
            diffs.append(f"  - source {name}: its corpus changed (files, sizes or fields)")
        diffs += [
            f"  - source {name}: {key} checkpoint {a[key]!r}, now {b[key]!r}"
            for key in ("weight", "tag")
            if a[key] != b[key]
        ]
    if not diffs and list(old) != list(new):
        diffs.append(f"  - order of data.sources: checkpoint {list(old)}, now {list(new)}")
    diffs += [
        f"  - data.{key}: checkpoint {saved[key]!r}, now {now[key]!r}"
        for key in now
        if key != "sources" and saved.get(key) != now[key]
    ]
    return diffs
