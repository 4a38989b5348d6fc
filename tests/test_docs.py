"""The docs site: its reference pages are what the code generates (a setting, metric or flag added without
regenerating fails here), every setting has a description, the metrics scan misses no metric a running
kvgate exports, and ``mkdocs build --strict`` passes (a broken link or a page missing from the nav fails)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from ext_proc.stats import Stats
from kvgate.dev import docs

ROOT = Path(__file__).resolve().parents[1]


def test_the_reference_pages_are_what_the_code_generates() -> None:
    assert docs.stale() == [], "run `make docs-reference` and commit docs/reference/"


def test_a_changed_page_is_found_stale(tmp_path: Path) -> None:
    for name, make in docs.PAGES.items():
        (tmp_path / name).write_text(make())
    assert docs.stale(tmp_path) == []
    (tmp_path / "metrics.md").write_text(docs.metrics_page().replace("kvgate_requests_total", "kvgate_x", 1))
    (tmp_path / "cli.md").unlink()
    assert docs.stale(tmp_path) == ["metrics.md", "cli.md"]


def test_every_setting_has_a_description() -> None:
    assert docs.undescribed() == [], "add description= to these fields (ext_proc/config.py, scaler/config.py)"


def test_every_key_of_the_example_config_is_in_the_reference() -> None:
    import yaml

    keys = {row[0] for row in docs.config_rows(docs._models()[0][2])}

    def walk(node: object, prefix: str) -> list[str]:
        if not isinstance(node, dict):
            return []
        out = []
        for k, v in node.items():
            key = prefix + str(k)
            if prefix == "tiers.":  # a tier's name is the user's: its keys are documented under <name>
                out += walk(v, "tiers.<name>.")
                continue
            out.append(key)
            if isinstance(v, list) and v and isinstance(v[0], dict):
                for item in v:
                    out += walk(item, key + "[].")
            else:
                out += walk(v, key + ".")
        return out

    example = yaml.safe_load((ROOT / "examples" / "kvgate.yaml").read_text())
    missing = sorted(set(walk(example, "")) - keys)
    assert missing == []


def test_the_metrics_scan_finds_every_metric_kvgate_exports() -> None:
    """The reference reads metric declarations from the source; a running Stats registry (the admission
    service's per-request, queue and node metrics) must hold no name the scan missed."""
    names = {row[0] for row in docs.metric_rows()}
    registry = CollectorRegistry()
    Stats(registry)
    exported = set()
    for fam in registry.collect():
        exported.add(fam.name + "_total" if fam.type == "counter" else fam.name)
    assert exported, "the registry exported nothing"
    assert sorted(exported - names) == []
    for elsewhere in ("kvgate_store_up", "kvgate_scaler_desired_replicas", "kvgate_task_restarts_total",
                      "kvgate_cpu_part_seconds_total"):
        assert elsewhere in names


def test_every_command_is_in_the_cli_reference() -> None:
    from kvgate.cli import parser

    page = docs.cli_page()
    for prog, _, _ in docs._subcommands(parser(benchmarks=True), "kvgate"):
        assert f"`{prog}`" in page
    assert "`kvgate bench scenarios`" in page and "`--metrics URL`" in page


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict`` in-process: broken links, missing anchors and pages left out of the nav
    are warnings, and strict turns each into a failure."""
    pytest.importorskip("mkdocs")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    cfg = load_config(config_file=str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site"))
    build(cfg)
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "troubleshooting" / "index.html").exists()


def test_the_reference_gives_each_metric_the_labels_it_is_declared_with() -> None:
    """The scan reads a metric's labels only where they are written out as a list; declared any other way
    (a constant, a computed list) the page would show none and still match what the generator makes. The
    running Stats declares its labels on each metric object: the page must list exactly those."""
    from ext_proc.stats import Counts, Hist

    page = {row[0]: row[2] for row in docs.metric_rows()}
    stats = Stats(CollectorRegistry())
    declared: dict[str, list[str]] = {}
    for value in vars(stats).values():
        if isinstance(value, Counts):
            declared[value.name if value.name.endswith("_total") else value.name + "_total"] = value.labels
        elif isinstance(value, Hist):
            declared[value.name] = value.labels
        elif hasattr(value, "_labelnames") and hasattr(value, "_name"):  # prometheus_client's own metrics
            suffix = "_total" if type(value).__name__ == "Counter" else ""
            declared[value._name + suffix] = list(value._labelnames)
    assert len(declared) >= 10, sorted(declared)
    for name, labels in declared.items():
        assert page.get(name) == ", ".join(f"`{x}`" for x in labels), name


def test_no_file_keeps_a_merge_conflict_marker() -> None:
    """Merge 8985cba committed ``<<<<<<< HEAD`` … ``>>>>>>> scaler11`` into scaler/law.py's docstring and the
    operator's autoscaling page (review11): Python parses it, the site renders both halves."""
    marked = []
    for w in ("ext_proc", "gpu_probe", "scaler", "sim", "kvgate", "tests", "docs", "helm", "examples", "envoy"):
        for p in sorted((ROOT / w).rglob("*")):
            if p.suffix not in (".py", ".md", ".yaml", ".yml", ".toml") or "__pycache__" in p.parts:
                continue
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
                if line.startswith(("<<<<<<< ", ">>>>>>> ")) or line == "=======":
                    marked.append(f"{p.relative_to(ROOT)}:{i}")
    assert not marked, marked
