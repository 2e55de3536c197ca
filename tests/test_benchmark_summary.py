"""The README's headline chart reads the committed benchmark results: every headline finds its workload, jinsum's
system and a peer (a renamed workload or system fails here, not in the README), and the chart renders."""

import importlib.util
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _plot_module():
    spec = importlib.util.spec_from_file_location("benchmarks_plot", BENCHMARKS / "plot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_every_headline_reads_its_committed_results(tmp_path):
    plot = _plot_module()
    rows = plot.read(BENCHMARKS / "results", "NVIDIA_H100_80GB_HBM3")
    assert [r["label"] for r in rows] == [h.label for h in plot.HEADLINES]
    for row in rows:
        assert row["jinsum"] > 0 and row["peer_ms"] > 0 and not row["peer"].startswith("jinsum")
    pytest.importorskip("matplotlib")
    plot.plot(rows, "NVIDIA_H100_80GB_HBM3", tmp_path / "summary.png")
    assert (tmp_path / "summary.png").stat().st_size > 10_000
    assert "| **" not in plot.markdown(rows).splitlines()[0]
