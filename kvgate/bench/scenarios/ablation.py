"""``kvgate bench ablation``: kvgate with each of its mechanisms off in turn, on every workload family.

Why: a figure for "kvgate" says how the whole does, not what each part buys; when a column regresses,
the ablation says which mechanism it came from, and when one mechanism costs more than it gives (issue
30: vLLM priority injection cost the interactive tail it was meant to protect) it shows as a row that
beats full kvgate. Each row is a configuration of the production core (``switches.py``: every mechanism
off by its own config key), over the very trace and fleet of the families benchmark (``families.family``:
same seeds, same ``--scale``), beside ``none``, ``kv-shed`` and full ``kvgate``:

* ``kvgate -NAME`` for each switch of ``switches.SWITCHES`` (quotas, queue, priority, breakers,
  predictions, prefix), everything else as the family configured it;
* ``kvgate all-off``: every switch at once.

Per family and seed it prints the families table's columns (``targets.COLUMNS``) and the batch tier's SLO
(``targets.ABLATION_COLUMNS``) for every row, with how many of issue 30's kvgate targets (``targets.py``:
against kv-shed and none) the row would meet in kvgate's place — a row's total is one higher where the
batch check applies to it; ``--json`` gives the same with stable field names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from . import report, targets
from .driver import Policy
from .families import FAMILIES, FamilyScenario, SeedRun, family, heading
from .runner import PolicyName, run
from .switches import SWITCHES

BASE_POLICIES: tuple[PolicyName, ...] = ("none", "kv-shed", "kvgate")
"""The rows every seed runs besides the variants (what the variants are read against)."""
ALL_OFF = "kvgate all-off"


def variant_name(off: Sequence[str]) -> str:
    """The row of kvgate with ``off`` switched off (``kvgate -quotas``; every switch: ``kvgate all-off``)."""
    if set(off) == set(SWITCHES) and len(SWITCHES) > 1:
        return ALL_OFF
    return "kvgate " + " ".join(f"-{n}" for n in off)


def variants(kvgate: Policy, switches: Sequence[str]) -> list[Policy]:
    """``kvgate`` with each of ``switches`` off in turn, then with all of them off (when more than one)."""
    unknown = [n for n in switches if n not in SWITCHES]
    if unknown:
        raise ValueError(f"unknown mechanism(s) {', '.join(unknown)}; known: {', '.join(SWITCHES)}")
    out = [replace(kvgate, name=variant_name((n,)), off=(n,)) for n in switches]
    if len(switches) > 1:
        everything = tuple(switches)
        name = ALL_OFF if set(everything) == set(SWITCHES) else variant_name(everything)
        out.append(replace(kvgate, name=name, off=everything))
    return out


def scenario(name: str, seed: int, switches: Sequence[str]) -> FamilyScenario:
    """The families benchmark's scenario for (``name``, ``seed``), with the ablation's rows as policies."""
    sc = family(name, seed, BASE_POLICIES)
    kvgate = next(p for p in sc.policies if p.name == "kvgate")
    return replace(sc, policies=(*sc.policies, *variants(kvgate, switches)))


@dataclass
class AblationSeed:
    run: SeedRun

    def rows(self) -> dict[str, report.Summary]:
        return targets.rows_by_policy(self.run.result.summaries)

    def row_checks(self) -> dict[str, list[targets.Check]]:
        """Each kvgate row's (full or ablated) issue-30 targets against kv-shed and none, as if it were kvgate."""
        rows = self.rows()
        base = {k: v for k, v in rows.items() if k in ("none", "kv-shed")}
        return {name: targets.checks({**base, "kvgate": s}) for name, s in rows.items()
                if name not in ("none", "kv-shed")}

    def table(self) -> str:
        checks = self.row_checks()
        out = []
        for name, s in self.rows().items():
            f = targets.figures(s)
            cs = checks.get(name)
            out.append([name, *(_cell(c, f[c]) for c in targets.ABLATION_COLUMNS), f"{s.gpu_hours:.2f}",
                        f"{sum(c.met for c in cs)}/{len(cs)}" if cs is not None else ""])
        return report.table(["row", *(targets.HEADERS[c] for c in targets.ABLATION_COLUMNS), "GPU-h", "targets met"],
                            out)

    def to_json(self) -> dict[str, Any]:
        checks = self.row_checks()
        rows = []
        for name, s in self.rows().items():
            cs = checks.get(name)
            rows.append({"variant": name, "off": list(s.result.policy.off),
                         **{k: v for k, v in targets.figures(s).items()},
                         **({"targets": targets.summary_json(cs)} if cs is not None else {})})
        return {**self.run.to_json(), "rows": rows}


def _cell(column: str, x: float | None) -> str:
    if x is None:
        return "-"
    if column in targets.SLO_COLUMNS:
        return f"{100 * x:.1f}%"
    return f"{x:.3f}" if column == "interactive_ttft_p99" else f"{x:.2f}"


@dataclass
class AblationFamily:
    family: str
    seeds: list[AblationSeed]
    seconds: float

    def markdown(self) -> str:
        parts = [heading(self.family)]
        for s in self.seeds:
            parts += [s.run.markdown(), s.table(), ""]
        return "\n".join([*parts, self.closing()])

    def closing(self) -> str:
        """What follows the seeds' tables: kvgate's targets per seed and the family's wall time."""
        return "\n".join(["kvgate's targets (issue 30) per seed:", "",
                          targets.table([(s.run.scenario.seed, s.row_checks()["kvgate"]) for s in self.seeds]), "",
                          f"Wall time for the family: {self.seconds:.1f} s.", ""])

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "about": FAMILIES[self.family], "wall_s": round(self.seconds, 3),
                "seeds": [s.to_json() for s in self.seeds]}


def run_ablation(name: str, seeds: Sequence[int], scale: float = 1.0, switches: Sequence[str] = tuple(SWITCHES),
                 on_seed: Callable[[AblationSeed], None] | None = None) -> AblationFamily:
    """Every row over each seed's scenario of family ``name`` (``runner.run``, the production path)."""
    t0 = time.perf_counter()
    out = []
    for seed in seeds:
        sc = scenario(name, seed, switches)
        s = AblationSeed(SeedRun(sc, run(sc, sc.trace(scale), scale)))
        out.append(s)
        if on_seed is not None:
            on_seed(s)
    return AblationFamily(name, out, time.perf_counter() - t0)


def to_json(results: Sequence[AblationFamily], seeds: Sequence[int], scale: float, switches: Sequence[str],
            seconds: float) -> dict[str, Any]:
    """The ``--json`` document (field names are stable)."""
    kv = Policy("kvgate", 1, "kvgate")
    return {"kind": "kvgate-bench-ablation", "version": 1, "scale": scale, "seeds": list(seeds),
            "switches": {n: SWITCHES[n][0] for n in switches},
            "rows": [*BASE_POLICIES, *(p.name for p in variants(kv, switches))],
            "columns": list(targets.COLUMNS), "window_s": report.JAIN_WINDOW_S,
            "tolerances": {"slo_points": 100 * targets.SLO_TOLERANCE, "goodput": targets.GOODPUT_TOLERANCE,
                           "ttft_factor": targets.TTFT_FACTOR, "jain": targets.JAIN_TOLERANCE,
                           "batch_points": 100 * targets.BATCH_TOLERANCE},
            "wall_s": round(seconds, 3), "families": [r.to_json() for r in results]}
