"""The test tiers (tests/tiers.py): every test has exactly one, read from its code, and a unit test that
starts a process fails instead of quietly slowing ``make test-unit`` down."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import tiers

ROOT = Path(__file__).resolve().parents[1]


def _runs_a_child() -> None:
    subprocess.run(["true"], check=True)


def _calls_a_helper_that_runs_a_child() -> None:
    _runs_a_child()


@contextlib.contextmanager
def _a_child_for_the_block() -> Iterator[None]:
    _runs_a_child()
    yield


def _uses_the_context_manager() -> None:
    with _a_child_for_the_block():
        pass


def _only_says_system() -> dict[str, str]:
    return {"role": "system", "content": "fork"}


class _Starter:
    def start(self) -> None:
        _runs_a_child()


def _makes_a_starter() -> None:
    _Starter().start()


@pytest.mark.parametrize("root", [_runs_a_child, _calls_a_helper_that_runs_a_child, _uses_the_context_manager,
                                  _makes_a_starter])
def test_a_process_is_found_through_helpers_of_tests(root: object) -> None:
    names, _ = tiers.signs([root])
    assert names & tiers.STARTS_PROCESS == {"subprocess"}


def test_strings_are_not_process_starters() -> None:
    names, strings = tiers.signs([_only_says_system])
    assert not names & tiers.STARTS_PROCESS
    assert {"system", "fork"} <= strings


@pytest.mark.unit  # stated: its own code names subprocess, which would make it e2e
def test_a_unit_test_cannot_start_a_process() -> None:
    with pytest.raises(AssertionError, match=r"is marked unit .* mark it @pytest.mark.e2e"):
        subprocess.run(["true"], check=True)
    with pytest.raises(AssertionError, match="is marked unit"):
        asyncio.run(asyncio.create_subprocess_exec("true"))
    with pytest.raises(AssertionError, match="is marked unit"):
        os.system("true")


def test_the_whole_suite_has_one_tier_per_test(tmp_path: Path) -> None:
    """One child collection of the whole suite, as ``make test`` sees it."""
    out = tmp_path / "tiers.json"
    code = ("import sys, pytest; from tests.tiers import Report; "
            f"sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests'], "
            f"plugins=[Report({str(out)!r})]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    marks: dict[str, list[str]] = json.loads(out.read_text())

    assert len(marks) > 800
    no_single_tier = {n: m for n, m in marks.items() if len(set(m) & set(tiers.TIERS)) != 1}
    assert not no_single_tier
    needs_but_in_process = {n: m for n, m in marks.items() if set(m) & set(tiers.NEEDS) and "e2e" not in m}
    assert not needs_but_in_process
    e2e_files_in_process = [n for n, m in marks.items() if n.split("::")[0].endswith("_e2e.py") and "e2e" not in m]
    assert not e2e_files_in_process
    by_tier = {t: sum(t in m for m in marks.values()) for t in tiers.TIERS}
    assert by_tier["unit"] > 500 and by_tier["e2e"] > 100, by_tier

    # each SLOW entry still names a test or a fixture of a collected file: a renamed test is not left behind
    stale = []
    for key in tiers.SLOW:
        file, name = key.split("::", 1)
        source = (ROOT / file).read_text() if (ROOT / file).is_file() else ""
        if f"def {name}(" not in source and f"{name} = " not in source:
            stale.append(key)
    assert not stale
