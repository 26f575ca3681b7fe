"""Each test's CPU seconds, its own and those of the processes it started and waited for, listed
at the end of a run beside --durations' wall seconds (the same number of tests): the suite is
CPU-bound (docs/development.md, "Where the time goes"), so what a test costs is its CPU, which
wall time hides when two tests share the cores. A test's processes count once they are waited
for (a launcher waits for its ranks); a daemon that outlives its test (the Slurm tests'
cluster) counts nowhere."""

from __future__ import annotations

import resource

import pytest

PROPERTY = "cpu_seconds"


def _cpu() -> float:
    own, waited = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


def _measured(item: pytest.Item):
    """Around one phase (setup, call, teardown): its CPU, on the item for the phase's report,
    which carries it to the controller under pytest-xdist."""
    start = _cpu()
    yield
    item.user_properties.append((PROPERTY, _cpu() - start))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _measured(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _measured(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _measured(item))


_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Each phase's report carries the properties of the phases so far: take its own, the last.
    values = [v for k, v in report.user_properties if k == PROPERTY]
    if values:
        _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + values[-1]


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    n = config.getoption("durations", None)
    if not n or not _seconds:
        return
    tr = terminalreporter
    tr.write_sep("=", f"most CPU: {n} tests (CPU seconds, each test's and its processes')")
    for nodeid, seconds in sorted(_seconds.items(), key=lambda kv: -kv[1])[:n]:
        tr.write_line(f"{seconds:8.1f} s  {nodeid}")
    total = sum(_seconds.values())
    tr.write_line(f"{total:8.1f} s  in all, {len(_seconds)} tests")
