"""The layout's one rule (docs/development/layout.md): the product never imports the tooling, so the image's
admission service, probe and scaler do not depend on the simulator, the dev stack or the benchmarks.
Read from the source (every import, at module level or inside a function), not from what one run
happens to import."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("ext_proc", "gpu_probe", "scaler", "kvgate/__init__.py", "kvgate/envoy_config.py", "kvgate/top.py")
TOOLING = ("sim", "kvgate.dev", "kvgate.bench", "tests")
ALLOWED = {("kvgate/top.py", "kvgate.dev.stack")}
"""``kvgate top`` borrows the stack's plain HTTP GET (docs/development/layout.md)."""


def imports(path: Path) -> list[tuple[str, bool]]:
    """(absolute module, at module level) for each import in ``path``, relative ones resolved."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    tree = ast.parse(path.read_text(), str(path))
    top = set(map(id, tree.body))
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            name = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module or ""
            found.append((name, id(node) in top))
    return found


def _files(*where: str) -> list[Path]:
    return [p for w in where for p in ([ROOT / w] if w.endswith(".py") else sorted((ROOT / w).rglob("*.py")))]


def _tooling(module: str) -> bool:
    return any(module == t or module.startswith(t + ".") for t in TOOLING)


def test_the_product_imports_no_tooling() -> None:
    wrong = [(str(p.relative_to(ROOT)), m) for p in _files(*PRODUCT) for m, _ in imports(p) if _tooling(m)]
    assert [w for w in wrong if w not in ALLOWED] == []


def test_the_command_line_reaches_the_tooling_only_inside_the_subcommands_that_use_it() -> None:
    assert [m for m, at_top in imports(ROOT / "kvgate" / "cli.py") if at_top and _tooling(m)] == []


def test_the_profiles_are_the_products_and_the_simulator_uses_them() -> None:
    assert ("ext_proc.profiles", True) in imports(ROOT / "sim" / "engine.py")
    assert not (ROOT / "sim" / "profiles.py").exists()


def test_the_import_reader_resolves_relative_imports() -> None:
    assert ("kvgate.dev.stack", True) in imports(ROOT / "kvgate" / "top.py")
    assert ("kvgate.envoy_config", True) in imports(ROOT / "kvgate" / "dev" / "stack.py")


def test_a_production_command_line_loads_no_tooling() -> None:
    """``kvgate extproc`` (and every command but ``bench``) builds the CLI without the benchmarks'
    subcommands, whose choices (scenario and family names) come from the benchmarks' modules: building
    it loaded the simulator into the admission service. A child process: this one has them loaded."""
    import subprocess
    import sys

    code = ("import sys\nfrom kvgate import cli\ntry:\n    cli.main(['extproc', '--help'])\nexcept SystemExit:\n"
            "    pass\nbad = sorted(m for m in sys.modules if m == 'sim' or m.startswith(('sim.', 'kvgate.bench',"
            " 'kvgate.dev')))\nprint('LOADED:' + ','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("LOADED:")]
    assert line == "LOADED:", line
