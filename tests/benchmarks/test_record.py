"""benchmarks/record.py: where a run writes its files, never over an earlier run's."""

from __future__ import annotations

import re

import pytest

from benchmarks import record


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(record, "_chosen", {})
    monkeypatch.delenv("BENCH_MACHINE", raising=False)
    return tmp_path / "results"


def test_a_run_writes_under_its_name_and_utc_stamp_with_its_plot_beside(results):
    assert re.fullmatch(r"\d{8}-\d{6}", record.STAMP)
    out = record.write("ttft", "{}")
    assert out == results / "ttft" / f"{record.STAMP}.json" and out.read_text() == "{}"
    assert record.run_file("ttft", ".png") == out.with_suffix(".png")
    assert record.run_file("ttft", ".png").parent.is_dir()


def test_the_machine_is_appended_to_the_stem(results, monkeypatch):
    monkeypatch.setenv("BENCH_MACHINE", "cuda-h100")
    assert record.run_file("ttft").name == f"{record.STAMP}-cuda-h100.json"


def test_a_run_rewrites_its_own_file_and_no_earlier_one(results):
    first = record.write("memory_peak", "rows so far")
    assert record.write("memory_peak", "all rows") == first and first.read_text() == "all rows"
    record._chosen.clear()  # another run with the same stamp: the file is not its own
    with pytest.raises(SystemExit, match="not overwriting"):
        record.run_file("memory_peak")
    assert first.read_text() == "all rows"


def test_a_given_file_that_exists_is_kept_and_the_run_writes_beside_it(results, tmp_path):
    given = tmp_path / "mine.json"
    assert record.write("ttft", "first", override=given) == given
    record._chosen.clear()
    second = record.write("ttft", "second", override=given)
    assert second == tmp_path / f"mine_{record.STAMP}.json"
    assert given.read_text() == "first" and second.read_text() == "second"
    assert not results.exists()


def test_a_study_writes_its_tables_plot_and_doc_section(results, tmp_path):
    doc = tmp_path / "STUDY.md"
    doc.write_text("# Study\n\n<!-- results:begin -->\nold\n<!-- results:end -->\nafter\n")
    drawn = []
    record.write_study("memory", "| a |\n", drawn.append, quick=False, doc=doc)
    stem = results / "memory" / record.STAMP
    assert stem.with_suffix(".md").read_text() == "| a |\n"
    assert drawn == [stem.with_suffix(".png")]
    assert doc.read_text() == ("# Study\n\n<!-- results:begin -->\n| a |\n<!-- results:end -->\n"
                               "after\n")


def test_a_quick_study_writes_only_the_plot_it_is_given(results, tmp_path):
    drawn = []
    record.write_study("memory", "| a |\n", drawn.append, quick=True)
    assert drawn == [] and not results.exists()
    record.write_study("memory", "| a |\n", drawn.append, quick=True, plot=tmp_path / "p.png")
    assert drawn == [tmp_path / "p.png"] and not results.exists()
