"""The README's table of rejection reasons lists exactly ``ext_proc.reasons.REASONS``, with the same status
and class: a reason added to (or removed from) the code without the documentation fails here."""

from __future__ import annotations

import re
from pathlib import Path

from ext_proc.reasons import REASONS

README = Path(__file__).resolve().parents[1] / "README.md"
HEADER = "| status | `x-kvgate-reject-reason` | class | when |"


def readme_reasons() -> dict[str, tuple[int, str]]:
    """reason → (status, class), from the README's reason table (one reason per row)."""
    lines = README.read_text().splitlines()
    assert lines.count(HEADER) == 1, "the README has exactly one reason table"
    rows: dict[str, tuple[int, str]] = {}
    for line in lines[lines.index(HEADER) + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        m = re.fullmatch(r"`([a-z0-9-]+)`", cells[1])
        assert m is not None, f"one reason per row, in backquotes: {line!r}"
        assert m.group(1) not in rows, f"{m.group(1)} listed twice"
        rows[m.group(1)] = (int(cells[0]), cells[2])
    return rows


def test_every_reason_in_the_code_is_in_the_readme_and_vice_versa() -> None:
    doc = readme_reasons()
    assert sorted(set(REASONS) - set(doc)) == [], "in ext_proc/reasons.py but not in the README's table"
    assert sorted(set(doc) - set(REASONS)) == [], "in the README's table but not in ext_proc/reasons.py"


def test_the_readme_gives_each_reason_its_status_and_class() -> None:
    doc = readme_reasons()
    wrong = {n: (doc[n], (r.status, r.klass)) for n, r in REASONS.items() if n in doc and doc[n] != (r.status, r.klass)}
    assert wrong == {}, "README (status, class) vs ext_proc/reasons.py"
