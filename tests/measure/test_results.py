"""The results store: provenance on every row and in the sidecar, one measurement per row, sources kept apart."""

import json

import pandas as pd
import pytest

from lab import paths
from lab.measure import results


def test_save_results_adds_provenance(tmp_path):
    df = pd.DataFrame({"x": [1, 2], "y": [0.5, 0.25]})
    path = results.save_results(df, "demo", tmp_path, params={"quick": True, "sizes": ["a"]})
    saved = pd.read_csv(path)
    assert {"gpu", "torch", "commit", "status"} <= set(saved.columns)
    assert list(saved["status"]) == ["ok", "ok"]
    meta = json.loads((tmp_path / "demo.json").read_text())
    for key in ("gpu", "gpu_count", "driver", "cuda", "torch", "triton", "commit", "date", "params"):
        assert key in meta
    assert meta["params"] == {"quick": True, "sizes": ["a"]} and meta["rows"] == 2


def test_a_table_without_source_is_replaced(tmp_path):
    results.save_results(pd.DataFrame({"a": [1, 2, 3]}), "other", tmp_path)
    results.save_results(pd.DataFrame({"a": [9]}), "other", tmp_path)
    assert list(results.load_results("other", tmp_path)["a"]) == [9]


def test_sources_replace_only_their_own_rows_and_never_fill_from_another_run(tmp_path):
    base = dict(size="small", context=512, batch=4, dtype="fp32", attention="sdpa", compile=False, world_size=1)
    results.save_results(pd.DataFrame([{**base, "fwd_ms": 1.0, "step_ms": 9.0}]), "lm_step", tmp_path,
                         params={"n": 1}, source="01_profiling")
    results.save_results(pd.DataFrame([{**base, "fwd_ms": 5.0, "step_ms": float("nan")}]), "lm_step", tmp_path,
                         params={"n": 2}, source="02_mixed_precision")
    # 01 re-measures the same configuration without the train step: its old row goes, nothing is filled in
    results.save_results(pd.DataFrame([{**base, "fwd_ms": 2.0, "step_ms": float("nan")}]), "lm_step", tmp_path,
                         params={"n": 3}, source="01_profiling")
    df = results.load_results("lm_step", tmp_path)
    assert len(df) == 2
    mine = results.load_results("lm_step", tmp_path, source="01_profiling")
    assert mine["fwd_ms"].tolist() == [2.0] and mine["step_ms"].isna().all()
    assert results.load_results("lm_step", tmp_path, source="02_mixed_precision")["fwd_ms"].tolist() == [5.0]
    # each source's provenance is its own run's
    assert results.load_provenance("lm_step", tmp_path, "01_profiling")["params"] == {"n": 3}
    assert results.load_provenance("lm_step", tmp_path, "02_mixed_precision")["params"] == {"n": 2}
    with pytest.raises(ValueError, match="pass source="):
        results.load_provenance("lm_step", tmp_path)
    with pytest.raises(FileNotFoundError, match="no rows from"):
        results.load_results("lm_step", tmp_path, source="05_flash")


def test_missing_table_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results table"):
        results.load_results("absent", tmp_path)


def test_commit_from_environment(monkeypatch):
    monkeypatch.setenv("LAB_COMMIT", "abc123")
    assert results.git_commit() == "abc123"
    assert results.provenance()["commit"] == "abc123"


def test_dirty_means_code_changed_not_outputs(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.delenv("LAB_COMMIT", raising=False)

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "results").mkdir()
    (tmp_path / "lab.py").write_text("x = 1\n")
    (tmp_path / "results" / "t.csv").write_text("a\n1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "one")
    clean = results.git_commit(tmp_path)
    assert len(clean) == 40 and "dirty" not in clean
    (tmp_path / "results" / "t.csv").write_text("a\n2\n")  # a render saving a table
    assert results.git_commit(tmp_path) == clean
    (tmp_path / "lab.py").write_text("x = 2\n")  # the code measured is not the commit's
    assert results.git_commit(tmp_path) == clean + "+dirty"


def test_provenance_line():
    meta = dict(gpu_count=2, gpu_name="NVIDIA H200", torch="2.11.0", triton="3.6.0", commit="abc", date="2026-11-26T01")
    assert results.provenance_line(meta) == "2 x NVIDIA H200, torch 2.11.0, triton 3.6.0, commit abc, 2026-11-26"


def test_committed_results_come_from_clean_commits():
    """A result committed to results/ names the exact commit that produced it: never a dirty tree."""
    folder = paths.REPO_ROOT / "results"
    dirty = []
    for side in sorted(folder.glob("*.json")):
        if "+dirty" in side.read_text():
            dirty.append(side.name)
    for csv in sorted(folder.glob("*.csv")):
        df = pd.read_csv(csv)
        if "commit" in df.columns and df["commit"].astype(str).str.contains("dirty").any():
            dirty.append(csv.name)
    assert not dirty, f"results from a tree with uncommitted changes: {dirty}"


def test_a_tables_own_source_column_is_refused(tmp_path):
    """01's kernel table had a 'source' column ('gpu kernel'): the store overwrote it and kept an older run's
    rows, whose 'source' was not the notebook's, beside the new ones."""
    df = pd.DataFrame({"name": ["gemm"], "source": ["gpu kernel"]})
    with pytest.raises(ValueError, match="column 'source' of its own"):
        results.save_results(df, "01_kernels", tmp_path, source="01_profiling")
    results.save_results(df.assign(source="01_profiling"), "01_kernels", tmp_path, source="01_profiling")
    results.save_results(df, "untagged", tmp_path)  # no source: the table is replaced whole


def test_measured_by_names_the_tables_this_commit_measured_on_this_kind_of_machine(tmp_path, monkeypatch):
    h200 = {"gpu_name": "NVIDIA H200", "gpu_count": 1}
    monkeypatch.setattr(results, "provenance", lambda params=None: {**h200, "gpu": "NVIDIA H200", "host_cpu": "x",
                                                                    "torch": "2", "commit": commit, "params": {}})
    for commit, name in (("a" * 40, "lm_step"), ("a" * 40, "warmup"), ("b" * 40, "kernels")):
        results.save_results(pd.DataFrame({"x": [1]}), name, tmp_path, source="01_profiling")
    results.save_results(pd.DataFrame({"x": [2]}), "lm_step", tmp_path, source="02_mixed_precision")
    assert results.measured_by("01_profiling", "a" * 40, tmp_path, here=h200) == ["lm_step", "warmup"]
    assert results.measured_by("02_mixed_precision", "a" * 40, tmp_path, here=h200) == []  # 02's rows: commit b
    assert results.measured_by("01_profiling", "a" * 40, tmp_path, here={**h200, "gpu_count": 2}) == []
    assert results.measured_by("01_profiling", "a" * 40 + "+dirty", tmp_path, here=h200) == []


def test_a_row_log_gives_back_only_this_commit_and_machine_kinds_rows_and_only_when_resuming(tmp_path):
    here = {"commit": "a" * 40, "gpu_name": "NVIDIA H200", "gpu_count": 1}
    path = tmp_path / "partial" / "01_profiling" / "lm_step.jsonl"
    log = results.RowLog(path, here=here)
    log.put({"size": "small", "context": 512}, {"fwd_ms": 17.9, "samples": [1.0, 2.0], "oom": float("nan")})
    log.put({"size": "xl", "context": 512}, {"fwd_ms": 106.0})
    with path.open("a") as f:
        f.write('{"key": "cut sh')  # the line a stopped render was writing
    again = results.RowLog(path, reuse=True, here=here)
    row = again.get({"context": 512, "size": "small"})  # keys compare as data, in any order
    assert row["fwd_ms"] == 17.9 and row["samples"] == [1.0, 2.0] and row["oom"] != row["oom"]
    assert again.get({"size": "large", "context": 512}) is None and again.reused == 1
    assert results.RowLog(path, reuse=True, here={**here, "gpu_count": 2}).get({"size": "xl", "context": 512}) is None
    # that log, opened on another kind of machine, kept none of the rows; a fresh render's log starts empty
    results.RowLog(path, here=here).put({"size": "xl", "context": 512}, {"fwd_ms": 99.0})
    dirty = results.RowLog(path, reuse=True, here={**here, "commit": "a" * 40 + "+dirty"})
    assert dirty.get({"size": "xl", "context": 512}) is None  # a dirty tree's rows are no commit's
    fresh = results.RowLog(path, here=here)
    assert results.RowLog(path, reuse=True, here=here).get({"size": "xl", "context": 512}) is None
    fresh.close()
    assert not path.exists()
