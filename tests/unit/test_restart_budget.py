"""benchmarks/_restart_budget.py: the restart at 1,024 ranks from phases measured at W = 1, 2, 4.
Made-up inputs, so that every figure below is worked out by hand."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from _restart_budget import (  # noqa: E402
    CONSTANT,
    GROWS,
    SHARE,
    PhaseModel,
    Target,
    budget,
    classify,
    zero3_models,
)


def test_measured_seconds_are_classified_as_falling_rising_or_neither():
    assert classify({1: 1.0, 2: 0.5, 4: 0.25}) == SHARE
    assert classify({1: 1.0, 2: 0.7, 4: 0.45}) == SHARE  # 0.45 <= (1/4) ** 0.5
    assert classify({1: 1.0, 2: 1.1, 4: 0.9}) == CONSTANT
    assert classify({1: 0.06, 2: 0.08, 4: 0.09}, {1: 1.0, 2: 2.0, 4: 3.0}) == CONSTANT  # noise
    assert classify({1: 0.2, 2: 0.4, 4: 0.8}) == GROWS
    # Under the noise floor at every W: nothing to tell, constant.
    assert classify({1: 0.01, 2: 0.05, 4: 0.09}) == CONSTANT
    # Four times slower at W = 4 because the machine was four times slower there: constant once
    # the contention is divided out, growing without.
    assert classify({1: 1.0, 2: 2.0, 4: 4.0}) == GROWS
    assert classify({1: 1.0, 2: 2.0, 4: 4.0}, {1: 1.0, 2: 2.0, 4: 4.0}) == CONSTANT


def test_each_kind_of_phase_is_extrapolated_and_the_total_is_their_sum():
    measured = {
        "imports": {1: 1.0, 2: 2.0, 4: 4.0},
        "verify": {1: 0.1, 2: 0.06, 4: 0.03},
        "plan": {1: 0.2, 2: 0.1, 4: 0.05},
        "group": {1: 0.5, 2: 1.0, 4: 2.1},
    }
    models = {
        "imports": PhaseModel(CONSTANT, "", extra_s=2.0),
        # 1 MB measured, hashed at 2 GB/s locally; 1 GB at the target, hashed and read at
        # 1 GB/s in all: 0.1 - 1e6 * 0.5e-9 + 1e9 / 100 * 1e-9.
        "verify": PhaseModel(
            SHARE,
            "",
            target_units=1e9,
            measured_units=1e6,
            s_per_unit=1e-9,
            local_s_per_unit=0.5e-9,
        ),
        # No stated rate: 0.2 s for 1,000 pairs measured, 100,000 pairs / 100 ranks.
        "plan": PhaseModel(SHARE, "", target_units=1e5, measured_units=1e3),
        # 100 x 99 requests at 0.1 ms on one host + 1 s.
        "group": PhaseModel(GROWS, "", requests=100 * 99, s_per_request=1e-4, extra_s=1.0),
    }
    rows, total = budget(measured, models, world=100)
    got = {r.phase: r.seconds for r in rows}
    assert got == pytest.approx({"imports": 3.0, "verify": 0.1095, "plan": 0.2, "group": 2.49})
    assert total == pytest.approx(5.7995)
    # The imports' own slowdown (1x, 2x, 4x) is the machine's: divided out, the plan falls and
    # the group, four times slower at W = 4 as the imports are, is constant.
    seen = {r.phase: r.seen for r in rows}
    assert seen == {"imports": CONSTANT, "verify": SHARE, "plan": SHARE, "group": CONSTANT}
    assert [r.kind for r in rows] == [CONSTANT, SHARE, SHARE, GROWS]
    # Measured from W = 2 on: a rank then held half the pairs, so each pair cost twice as much.
    from_two = {phase: {w: s for w, s in got.items() if w > 1} for phase, got in measured.items()}
    rows, _ = budget(from_two, {"plan": models["plan"], "imports": models["imports"]}, world=100)
    assert rows[0].seconds == pytest.approx(0.1 / 500 * 1e5 / 100)


def target(world: int) -> Target:
    return Target(
        world=world,
        ckpt_bytes=213e6 * 16,
        cache_bytes=0.4e9,
        pairs=4.5e6,
        measured_ckpt_bytes=2e6,
        measured_cache_bytes=0.2e6,
        measured_pairs=4000,
        sha256_gbps=2.0,
        fs_gbps=1.0,
        store_requests_per_s=50_000,
        store_multi_gets_per_s=10_000,
        nccl_init_s=10.0,
        model_init_s=3.0,
        first_step_s=3.0,
    )


def test_at_1024_ranks_only_the_store_grows_and_the_checkpoint_is_a_share():
    measured = {phase: {1: 0.0, 2: 0.0, 4: 0.0} for phase in zero3_models(target(1))}
    measured["data position"] = {1: 0.1, 2: 0.05, 4: 0.025}  # 0.1 s for 4,000 pairs
    at = {}
    for world in (64, 1024):
        rows, total = budget(measured, zero3_models(target(world)), world)
        at[world] = {r.phase: r.seconds for r in rows} | {"total": total}
    # 213M parameters x 16 bytes / 1,024 ranks, hashed at 2 GB/s and read at 1 GB/s.
    assert at[1024]["checkpoint verify"] == pytest.approx(213e6 * 16 / 1024 * 1.5e-9)
    assert at[1024]["checkpoint load"] == pytest.approx(213e6 * 16 / 1024 * 1e-9)
    assert at[1024]["data position"] == pytest.approx(0.1 / 4000 * 4.5e6 / 1024)
    # 3 requests a rank + 2 gloo groups' keys, one a rank, at 50,000/s; each rank of each
    # group reads the 1,024 keys in 8 reads of 128 at 10,000/s; + NCCL's 10 s.
    assert at[1024]["process group"] == pytest.approx(
        (3 * 1024 + 2 * 1024) / 50_000 + 2 * 1024 * 8 / 10_000 + 10
    )
    grew = {p for p in at[64] if p != "total" and at[1024][p] > at[64][p] + 1e-9}
    fell = {p for p in at[64] if p != "total" and at[1024][p] < at[64][p] - 1e-9}
    assert grew == {"process group"}
    assert fell == {"tokenizer/data", "checkpoint verify", "checkpoint load", "data position"}
    assert at[1024]["total"] == pytest.approx(sum(v for p, v in at[1024].items() if p != "total"))
