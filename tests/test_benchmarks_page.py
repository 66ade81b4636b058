"""docs/benchmarks.md is the page benchmarks/make_page.py builds from the benchmark folders: a result
that changed without the page (or a folder without its README, command or report) fails here."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _make_page():
    spec = importlib.util.spec_from_file_location("make_page", ROOT / "benchmarks" / "make_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_page_is_generated_from_the_folders():
    assert (ROOT / "docs" / "benchmarks.md").read_text() == _make_page().page(), \
        "regenerate it: make benchmarks-page"


def test_every_benchmark_folder_has_a_command_and_a_report_and_is_on_the_page():
    listed = {name for _, _, entries in _make_page().SECTIONS for name, _ in entries}
    folders = {path.name for path in (ROOT / "benchmarks").iterdir() if path.is_dir()}
    assert folders == listed
    for name in folders:
        readme = (ROOT / "benchmarks" / name / "README.md").read_text()
        assert "## Command" in readme and "## Current result" in readme, name
        assert (ROOT / "benchmarks" / name / "report.md").is_file(), name


def test_the_campaign_page_and_the_readme_headline_are_generated_from_the_reports():
    module = _make_page()
    assert (ROOT / "docs" / "campaign.md").read_text() == module.campaign_page(), "regenerate it: make benchmarks-page"
    readme = (ROOT / "README.md").read_text()
    assert readme == module.readme(readme), "regenerate the README's headline: make benchmarks-page"
    for name in module.CAMPAIGNS:
        assert name in {n for _, _, entries in module.SECTIONS for n, _ in entries}


def test_the_time_breakdown_multiplies_to_the_campaigns_x_limit():
    """The generated 'where the time goes' factors of each campaign multiply to the x limit its
    report computed (the same composition, from summary.json)."""
    import json

    module = _make_page()
    checked = 0
    for name in module.CAMPAIGNS:
        summary = json.loads((ROOT / "benchmarks" / name / "summary.json").read_text())
        for goal in summary["goals"]:
            row = module.time_breakdown(summary, goal["network"])
            if row is None or "x limit" not in goal:
                continue
            product = float(row["x steps"]) * float(row["x step"]) * float(row["x warm-up"])
            assert abs(float(row["x limit"]) - goal["x limit"]) < 0.006, (name, goal["network"])
            assert abs(product - goal["x limit"]) < 0.02 * goal["x limit"], (name, goal["network"])
            # a free exchange leaves the steps and the warm-up: never more than the x limit, never under x steps
            free = float(row["x limit, main step at the floor's"])
            assert float(row["x steps"]) - 0.01 <= free <= float(row["x limit"]) + 0.01, (name, goal["network"])
            checked += 1
    assert checked >= 3
