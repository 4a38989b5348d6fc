"""Test tiers: which tests run in-process in seconds, and which start real processes.

Every collected test gets exactly one **tier** marker:

* ``unit`` — in-process only, never a child process: ``make test-unit`` (about a minute on 2 cores);
* ``slow`` — in-process too, but too long for that minute (long virtual-time runs, large property tests);
* ``e2e``  — starts real processes: kvgate, Envoy, simulated nodes, probes, redis-server, Prometheus,
  helm, a ``python -m`` or ``kvgate`` child.

and, where it needs a binary from outside the Python environment, a **needs** marker: ``envoy``,
``redis``, ``prometheus``, ``helm`` (``-m redis`` runs just those; ``-m "not prometheus"`` skips them).

Why read the tier from the code rather than keep a list per file: a list goes stale the day someone
adds a test, and files mix both kinds (``test_demo.py`` has pure ``top`` tests beside a running
stack). A test is ``e2e`` when its function, the fixtures it requests, or any function or class of
``tests/`` those name — followed transitively — names something that starts a process
(:data:`STARTS_PROCESS`). A test, class or module may state its tier itself (``@pytest.mark.e2e``,
``pytestmark``); that wins, and :data:`SLOW` lists the in-process tests that do not fit the minute.
The guess is never trusted blindly: a ``unit`` test that starts a process anyway fails at once
(:func:`refuse_processes`, used by ``conftest.py``), naming the marker to add.
"""

from __future__ import annotations

import _posixsubprocess
import json
import os
import subprocess
import types
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

TIERS = ("unit", "slow", "e2e")
NEEDS = ("envoy", "redis", "prometheus", "helm")

STARTS_PROCESS = frozenset({
    # the primitives
    "subprocess", "Popen", "create_subprocess_exec", "create_subprocess_shell", "fork", "posix_spawn", "system",
    "multiprocessing", "ProcessPoolExecutor",
    # the product's and the tooling's own process starters, often imported inside a test function
    "Stack", "run_live", "RedisServer",
})
"""Names (of modules, functions, classes, attributes; not strings: a chat message's role is "system")
whose use in a test's code means it starts a process."""

NEED_SIGNS: dict[str, frozenset[str]] = {
    "envoy": frozenset({"Stack", "envoy_binary", "run_live"}),
    "redis": frozenset({"RedisServer", "redis_binary", "redis-server"}),
    "prometheus": frozenset({"prometheus", "promtool"}),
    "helm": frozenset({"helm_binary"}),
}
"""Per needs marker: names or string constants in an ``e2e`` test's code that mean it runs that binary."""

SLOW: dict[str, str] = {
    # virtual-time runs of whole scenarios (tens of thousands of requests through the real core)
    "tests/test_two_pools_scenario.py::res": "the two-pools scenario at full scale, ~25 s",
    "tests/test_scenarios.py::at_tenth": "every scenario at a tenth of its scale",
    "tests/test_scenarios.py::test_each_scenario_is_deterministic_and_accounts_for_every_request":
        "every scenario twice",
    "tests/test_scenarios.py::test_the_scaler_adds_nodes_on_capacity_rejections": "a scaled scenario, ~10 s",
    "tests/test_scenarios.py::test_the_baselines_are_what_they_claim": "a scenario under three policies",
    "tests/test_perf.py::test_no_latency_breaker_opens_on_a_healthy_busy_mixed_fleet": "minutes of a busy fleet",
    "tests/test_scale.py::test_a_large_fleet_chooses_as_it_did_when_every_holder_was_matched": "a large fleet",
    # property tests with many examples
    "tests/test_core_properties.py::TestCore": "a hypothesis state machine over the whole core",
    "tests/test_core_properties.py::TestPools": "a hypothesis state machine over pooled cores",
    "tests/test_bad_input_estimate.py::test_estimator_never_raises_anything_but_invalid": "arbitrary JSON bodies",
    # real time
    "tests/test_follow.py::test_a_stream_that_goes_mute_is_dropped_and_connected_again": "waits out a mute stream",
    # a process outside the test's own code
    "tests/test_demo.py::test_the_report_writes_its_plots":
        "matplotlib: its first import builds a font cache, running fc-list",
}
"""In-process tests kept out of ``make test-unit`` (each over ~3 s on a busy 2-core machine), and why: by
node id without parameters (``tests/test_x.py::test_y``, or ``::Class``), or by a fixture of that file
(``tests/test_x.py::fixture``) for every test that uses it."""



def _of_tests(obj: object) -> bool:
    """Whether ``obj`` is defined in ``tests/`` (whose code :func:`signs` follows)."""
    module = str(getattr(obj, "__module__", ""))
    return module == "tests" or module.startswith("tests.")


def _code_signs(code: types.CodeType) -> Iterator[tuple[str, bool]]:
    """(sign, is_a_name) for the global and attribute names and the string constants of ``code`` and of
    the code nested in it."""
    for n in code.co_names:
        yield n, True
    for c in code.co_consts:
        if isinstance(c, str):
            yield c, False
        elif isinstance(c, types.CodeType):
            yield from _code_signs(c)


def _functions_of(obj: object) -> Iterator[types.FunctionType]:
    """The plain functions behind ``obj``: itself, or a class's methods and properties."""
    if isinstance(obj, types.FunctionType):
        yield obj
    elif isinstance(obj, type):
        for v in vars(obj).values():
            if isinstance(v, staticmethod | classmethod):
                v = v.__func__
            elif isinstance(v, property):
                v = v.fget
            if isinstance(v, types.FunctionType):
                yield v


def signs(roots: Iterable[object]) -> tuple[set[str], set[str]]:
    """(names, strings): every name and string constant the code of ``roots`` uses, and those of every
    function or class of ``tests/`` it names, transitively (the product's code is not followed: its
    process starters are listed by name in :data:`STARTS_PROCESS`)."""
    names: set[str] = set()
    strings: set[str] = set()
    seen: set[int] = set()
    todo = [f for r in roots for f in _functions_of(unwrap(r))]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        for sign, is_name in _code_signs(f.__code__):
            if not is_name:
                strings.add(sign)
                continue
            names.add(sign)
            g = unwrap(f.__globals__.get(sign))
            if _of_tests(g):
                todo.extend(_functions_of(g))
    return names, strings


def unwrap(obj: object) -> object:
    """A decorated function's own function (``functools.wraps`` chains as ``@contextmanager`` makes them,
    hypothesis' ``@given``)."""
    while True:
        inner = getattr(obj, "__wrapped__", None) or getattr(getattr(obj, "hypothesis", None), "inner_test", None)
        if inner is None or inner is obj:
            return obj
        obj = inner


def _fixture_functions(item: pytest.Item) -> list[object]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [d.func for defs in info.name2fixturedefs.values() for d in defs]


def _slow_ids(item: pytest.Item) -> set[str]:
    """The ids :data:`SLOW` may name ``item`` by: its node id without parameters, its class's, and
    ``file::fixture`` for each fixture it uses."""
    base = item.nodeid.split("[", 1)[0]
    ids = {base, base.rsplit("::", 1)[0]} if base.count("::") > 1 else {base}
    for f in map(unwrap, _fixture_functions(item)):
        module = str(getattr(f, "__module__", ""))
        ids.add(f"{module.replace('.', '/')}.py::{getattr(f, '__name__', '')}")
    return ids


def classify(item: pytest.Item) -> tuple[str, tuple[str, ...]]:
    """(tier, needs) of one collected test; a tier stated on the test, its class or module wins."""
    stated = {m.name for m in item.iter_markers() if m.name in TIERS}
    if len(stated) > 1:
        raise pytest.UsageError(f"{item.nodeid}: more than one tier marker ({', '.join(sorted(stated))}); "
                                f"a test has exactly one of {', '.join(TIERS)}")
    names, strings = signs([getattr(item, "function", None), *_fixture_functions(item)])
    if stated:
        tier = stated.pop()
    elif names & STARTS_PROCESS:
        tier = "e2e"
    elif _slow_ids(item) & SLOW.keys():
        tier = "slow"
    else:
        tier = "unit"
    needs = tuple(n for n in NEEDS if tier == "e2e" and (names | strings) & NEED_SIGNS[n])
    return tier, needs


def mark(items: list[pytest.Item]) -> None:
    """Give every item its tier and needs markers (``pytest_collection_modifyitems``)."""
    for item in items:
        tier, needs = classify(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)
        for n in needs:
            if item.get_closest_marker(n) is None:
                item.add_marker(n)


def refuse_processes(nodeid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every way of starting a process fail for the rest of a ``unit`` test, naming the fix: the
    classification guessed wrong, and a unit tier that quietly starts processes is neither fast nor
    runnable without the binaries."""

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError(f"{nodeid} is marked unit (tests/tiers.py) but starts a process: "
                             "mark it @pytest.mark.e2e, or name its process starter in tiers.STARTS_PROCESS")

    starters: tuple[tuple[Any, str], ...] = (
        (subprocess.Popen, "_execute_child"),  # subprocess.*, asyncio's subprocesses
        (_posixsubprocess, "fork_exec"),  # multiprocessing's spawn
        (os, "fork"), (os, "forkpty"), (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"))
    for owner, name in starters:
        if hasattr(owner, name):
            monkeypatch.setattr(owner, name, refuse)



class Report:
    """A pytest plugin writing each collected test's tier and needs markers as JSON (``{nodeid: [names]}``)
    to ``path``: how ``test_tiers.py`` checks the whole suite's marking from one child collection."""

    def __init__(self, path: str) -> None:
        self.path = path

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        marks = {i.nodeid: sorted({m.name for m in i.iter_markers() if m.name in TIERS + NEEDS}) for i in session.items}
        with open(self.path, "w") as f:
            json.dump(marks, f)
