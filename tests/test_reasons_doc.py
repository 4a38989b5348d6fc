"""The docs' table of rejection reasons (docs/reference/troubleshooting.md) lists exactly
``ext_proc.reasons.REASONS``, with the same status and class, and says what to do about each: a reason
added to (or removed from) the code without the documentation fails here."""

from __future__ import annotations

import re
from pathlib import Path

from ext_proc.reasons import REASONS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "troubleshooting.md"
HEADER = "| status | `x-kvgate-reject-reason` | class | when | what to do |"


def doc_reasons() -> dict[str, tuple[int, str]]:
    """reason → (status, class), from the troubleshooting page's reason table (one reason per row, each
    with something in its "what to do" cell)."""
    lines = PAGE.read_text().splitlines()
    assert lines.count(HEADER) == 1, "the troubleshooting page has exactly one reason table"
    rows: dict[str, tuple[int, str]] = {}
    for line in lines[lines.index(HEADER) + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        m = re.fullmatch(r"`([a-z0-9-]+)`", cells[1])
        assert m is not None, f"one reason per row, in backquotes: {line!r}"
        assert m.group(1) not in rows, f"{m.group(1)} listed twice"
        assert cells[4], f"{m.group(1)}: no 'what to do'"
        rows[m.group(1)] = (int(cells[0]), cells[2])
    return rows


def test_every_reason_in_the_code_is_in_the_docs_and_vice_versa() -> None:
    doc = doc_reasons()
    assert sorted(set(REASONS) - set(doc)) == [], "in ext_proc/reasons.py but not in the troubleshooting table"
    assert sorted(set(doc) - set(REASONS)) == [], "in the troubleshooting table but not in ext_proc/reasons.py"


def test_the_docs_give_each_reason_its_status_and_class() -> None:
    doc = doc_reasons()
    wrong = {n: (doc[n], (r.status, r.klass)) for n, r in REASONS.items() if n in doc and doc[n] != (r.status, r.klass)}
    assert wrong == {}, "troubleshooting page (status, class) vs ext_proc/reasons.py"
