"""``make image``: build kvgate's container image from the ``Dockerfile`` with whichever builder works
here (docker, podman or buildah), tagged as the Helm chart pulls it by default.

The chart is the one place the published name lives (``image.repository`` in ``values.yaml``, the tag
defaulting to ``appVersion`` in ``Chart.yaml``), so the image built here and the image the chart
asks for cannot drift apart; ``tests/test_image.py`` checks that ``appVersion`` is the package's version,
which is what a release publishes. Where no builder works, say which were found and why each did not
work, and exit 1: a build that silently did nothing would read as success.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvgate"
BUILDERS: dict[str, tuple[list[str], list[str]]] = {
    "docker": (["info"], ["build"]),
    "podman": (["info"], ["build"]),
    "buildah": (["version"], ["bud"]),
}
"""Builder → (the command that fails when it cannot build here, its build subcommand)."""


def reference(chart: Path = CHART) -> str:
    """``repository:tag`` the chart pulls with its default values."""
    values = yaml.safe_load((chart / "values.yaml").read_text())
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    return f"{values['image']['repository']}:{values['image']['tag'] or meta['appVersion']}"


def _works(path: str, probe: list[str]) -> str | None:
    """None when the builder answers; else why not (its first line of complaint)."""
    try:
        r = subprocess.run([path, *probe], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if r.returncode == 0:
        return None
    lines = [x for x in (r.stderr or r.stdout).splitlines() if x.strip()]
    return lines[-1].strip() if lines else f"exit status {r.returncode}"


def choose(which: Callable[[str], str | None] = shutil.which,
           works: Callable[[str, list[str]], str | None] = _works) -> tuple[str | None, list[str]]:
    """The first builder on PATH that works (its path, or None), and why each other one was passed over."""
    notes: list[str] = []
    for name, (probe, _) in BUILDERS.items():
        path = which(name)
        if path is None:
            continue
        problem = works(path, probe)
        if problem is None:
            return path, notes
        notes.append(f"{name} ({path}) cannot build here: {problem}")
    return None, notes


def build_command(builder: str, ref: str, root: Path = ROOT) -> list[str]:
    return [builder, *BUILDERS[Path(builder).name][1], "-t", ref, "-f", str(root / "Dockerfile"), str(root)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvgate.dev.image", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", default=None, help="repository:tag to build (default: what the chart pulls)")
    ap.add_argument("--push", action="store_true", help="push it after building")
    ap.add_argument("--print", action="store_true", help="only print the reference the chart pulls")
    a = ap.parse_args(argv)
    ref = a.tag or reference()
    if a.print:
        print(ref)
        return 0
    builder, notes = choose()
    if builder is None:
        print("make image: no container builder works here (docker, podman or buildah); nothing was built.",
              file=sys.stderr)
        for n in notes:
            print(f"  {n}", file=sys.stderr)
        print(f"  Install one, or build elsewhere: docker build -t {ref} .", file=sys.stderr)
        return 1
    for cmd in [build_command(builder, ref)] + ([[builder, "push", ref]] if a.push else []):
        print("+ " + " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
