"""lab.measure.memory_pages: a snapshot's phase peaks and pages, from the synthetic snapshot of tests/fixtures."""

import importlib.util
import json
import shutil
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from lab.measure import memory_pages as sn  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture
def snapshot_dir(tmp_path):
    """The synthetic snapshot of tests/fixtures with its phase marks in the sidecar the recorder writes."""
    spec = importlib.util.spec_from_file_location("fix", FIXTURES / "make_snapshot_fixture.py")
    fix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fix)
    shutil.copy(FIXTURES / "synthetic_snapshot.pickle", tmp_path / "forward.pickle")
    (tmp_path / "forward.phases.json").write_text(json.dumps({"marks": fix.MARKS}))
    return tmp_path


def test_offline_page_is_self_contained_and_memory_viz_is_not(snapshot_dir):
    pages = sn.export_snapshot_pages(snapshot_dir, ["forward", "missing"], titles={"forward": "a <toy> forward"})
    assert pages["page"].tolist() == ["offline (PNG + tables)", "memory_viz"]  # no pickle, no pages
    offline = Path(pages.loc[0, "path"]).read_text()
    assert "data:image/png;base64," in offline and "<script" not in offline
    assert "a &lt;toy&gt; forward" in offline  # the title is escaped
    assert "model.py:208:forward" in offline  # the largest allocations' origins are in the page
    assert sn.external_resources(offline) == []
    viz = Path(pages.loc[1, "path"]).read_text()
    assert sn.external_resources(viz) == [
        "https://cdn.jsdelivr.net/gh/pytorch/pytorch@main/torch/utils/viz/MemoryViz.js"]
    assert pages["works_offline"].tolist() == [True, False]
    peaks = sn.marked_phase_peaks(sn.load_snapshot(snapshot_dir / "forward.pickle"),
                                  sn.load_marks(snapshot_dir / "forward.pickle"))
    assert "" not in set(peaks["phase"]) and "end" not in set(peaks["phase"])  # marked phases only
    assert sn.phase_label("optimizer_step 1") == "optimizer step 1"


def test_external_resources_finds_every_kind_of_link():
    page = ('<link rel="stylesheet" href="https://a.example/s.css"><img src="//b.example/i.png">'
            '<script type="module">import {x} from "https://c.example/m.js"</script>'
            '<style>@import "https://d.example/f.css"; .x{background:url(https://e.example/p.png)}</style>'
            '<a>https://not-loaded.example is only text</a><img src="data:image/png;base64,AAAA">')
    assert sn.external_resources(page) == ["//b.example/i.png", "https://a.example/s.css", "https://c.example/m.js",
                                           "https://d.example/f.css", "https://e.example/p.png"]
