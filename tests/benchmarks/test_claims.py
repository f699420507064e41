"""benchmarks/claims.py: every figure the README and the benchmark report quote is recomputed
from its raw file, and the check fails when the text says otherwise."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import claims

CLAIM = """
[[claim]]
id = "ttft.warm.ours"
file = "benchmarks/results/ttft/20261128-101010.json"
value = "summary.ours.warm_s"
format = "{:.2f} s"

[[claim]]
id = "ttft.warm.ratio"
file = "benchmarks/results/ttft/20261128-101010.json"
value = "peer / ours"
format = "{:.1f}x"
[claim.fields]
ours = "summary.ours.warm_s"
peer = "summary.peer.0"
"""


def project(tmp_path: Path, readme: str, *, later_run: str | None = None) -> Path:
    (tmp_path / "docs").mkdir(parents=True)
    (tmp_path / "docs" / "BENCHMARKS.md").write_text("# Benchmarks\n")
    (tmp_path / "README.md").write_text(readme)
    runs = tmp_path / "benchmarks" / "results" / "ttft"
    runs.mkdir(parents=True)
    (tmp_path / "benchmarks" / "claims.toml").write_text(CLAIM)
    (runs / "20261128-101010.json").write_text(
        json.dumps({"summary": {"ours": {"warm_s": 0.3612}, "peer": [1.1]}}))
    if later_run:
        (runs / later_run).write_text("{}")
    return tmp_path


GOOD = "| warm | 0.36 s<!-- ttft.warm.ours --> | **3.0x**<!-- ttft.warm.ratio --> (goal <= 0.5x) |\n"


def test_the_project_docs_say_what_their_raw_files_say():
    found = claims.problems()
    assert not found, "\n".join(found)


def test_figures_that_match_their_raw_files_pass(tmp_path):
    assert claims.problems(project(tmp_path, GOOD)) == []


def test_a_figure_the_raw_file_does_not_say_fails(tmp_path):
    found = claims.problems(project(tmp_path, GOOD.replace("0.36 s", "0.30 s")))
    assert len(found) == 1 and "claim ttft.warm.ours is '0.36 s'" in found[0]


def test_a_computed_figure_is_recomputed(tmp_path):
    found = claims.problems(project(tmp_path, GOOD.replace("3.0x", "3.1x")))
    assert len(found) == 1 and "ttft.warm.ratio is '3.0x'" in found[0]


def test_a_marker_naming_no_claim_and_a_claim_quoted_nowhere_fail(tmp_path):
    found = claims.problems(project(tmp_path, GOOD.replace("ttft.warm.ratio", "ttft.cold.ratio")))
    assert any("marker ttft.cold.ratio names no claim" in p for p in found)
    assert any("claim ttft.warm.ratio is quoted nowhere" in p for p in found)


def test_a_claim_from_an_older_run_fails(tmp_path):
    found = claims.problems(project(tmp_path, GOOD, later_run="20261129-080000.json"))
    assert len(found) == 2 and all("is not the latest run" in p for p in found)
    # a later run on another machine is that machine's latest, not this one's
    assert claims.problems(project(tmp_path / "b", GOOD,
                                   later_run="20261129-080000-cuda-h100.json")) == []


def test_a_result_figure_without_a_claim_fails_but_goals_and_code_do_not(tmp_path):
    readme = GOOD + ("Turn 2 takes 1.2 s here.\nThe goal is **<= 0.5x**; at most 200 ms.\n"
                     "```\nbench --width 2.5x\n```\nRun `x --limit 3s`.\n")
    found = claims.problems(project(tmp_path, readme))
    assert len(found) == 1 and "unclaimed figure" in found[0] and "'1.2 s'" in found[0]
