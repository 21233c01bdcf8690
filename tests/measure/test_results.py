import json

import pandas as pd
import pytest

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


def test_headline_tables_merge_by_key(tmp_path):
    base = dict(context=512, batch=4, dtype="fp32", attention="sdpa", compile=False, world_size=1, gpu="G")
    results.save_results(pd.DataFrame([{**base, "size": "small", "fwd_ms": 1.0},
                                       {**base, "size": "medium", "fwd_ms": 2.0}]), "lm_step", tmp_path)
    results.save_results(pd.DataFrame([{**base, "size": "medium", "fwd_ms": 3.0},
                                       {**base, "size": "large", "fwd_ms": 4.0}]), "lm_step", tmp_path)
    df = results.load_results("lm_step", tmp_path).set_index("size")
    assert df.loc["small", "fwd_ms"] == 1.0 and df.loc["medium", "fwd_ms"] == 3.0 and df.loc["large", "fwd_ms"] == 4.0
    assert len(df) == 3


def test_non_headline_tables_are_replaced(tmp_path):
    results.save_results(pd.DataFrame({"a": [1, 2, 3]}), "other", tmp_path)
    results.save_results(pd.DataFrame({"a": [9]}), "other", tmp_path)
    assert list(results.load_results("other", tmp_path)["a"]) == [9]


def test_missing_table_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results table"):
        results.load_results("absent", tmp_path)


def test_commit_from_environment(monkeypatch):
    monkeypatch.setenv("LAB_COMMIT", "abc123")
    assert results.git_commit() == "abc123"
    assert results.provenance()["commit"] == "abc123"


def test_merge_with_missing_key_values(tmp_path):
    row = dict(impl="naive", bucket_mb=float("nan"), world_size=2, size="xl", context=512, batch=2, dtype="fp32",
               gpu="G")
    results.save_results(pd.DataFrame([{**row, "step_ms": 1.0}]), "ddp_benchmark", tmp_path)
    results.save_results(pd.DataFrame([{**row, "step_ms": 2.0}, {**row, "impl": "flat", "step_ms": 3.0}]),
                         "ddp_benchmark", tmp_path)
    df = results.load_results("ddp_benchmark", tmp_path)
    assert sorted(df["step_ms"]) == [2.0, 3.0]


def test_replacing_row_keeps_columns_it_does_not_measure(tmp_path):
    base = dict(size="small", context=512, batch=4, dtype="fp32", attention="sdpa", compile=False, world_size=1,
                gpu="G")
    results.save_results(pd.DataFrame([{**base, "fwd_ms": 1.0, "step_ms": 9.0}]), "lm_step", tmp_path)
    results.save_results(pd.DataFrame([{**base, "fwd_ms": 2.0, "step_ms": float("nan")}]), "lm_step", tmp_path)
    df = results.load_results("lm_step", tmp_path)
    assert len(df) == 1 and df["fwd_ms"].iloc[0] == 2.0 and df["step_ms"].iloc[0] == 9.0


def test_oom_status_survives_a_partial_remeasurement(tmp_path):
    base = dict(size="10B", context=512, batch=4, dtype="fp32", attention="sdpa", compile=False, world_size=1,
                gpu="G")
    results.save_results(pd.DataFrame([{**base, "fwd_ms": 1.0, "step_ms": float("nan"), "status": "oom",
                                        "error": "train_step: OutOfMemoryError"}]), "lm_step", tmp_path)
    results.save_results(pd.DataFrame([{**base, "fwd_ms": 2.0, "step_ms": float("nan"), "status": "ok",
                                        "error": ""}]), "lm_step", tmp_path)
    row = results.load_results("lm_step", tmp_path).iloc[0]
    assert row["status"] == "oom" and "train_step" in row["error"] and row["fwd_ms"] == 2.0


def test_combine_results_merges_headline_tables_and_keeps_provenance(tmp_path):
    base = dict(context=512, batch=4, dtype="fp32", attention="sdpa", compile=False, world_size=1, gpu="G")
    a, b, dst = tmp_path / "a", tmp_path / "b", tmp_path / "dst"
    results.save_results(pd.DataFrame([{**base, "size": "small", "fwd_ms": 1.0}]), "lm_step", a)
    results.save_results(pd.DataFrame({"x": [1]}), "other", a)
    results.save_results(pd.DataFrame([{**base, "size": "large", "fwd_ms": 2.0}]), "lm_step", b)
    results.combine_results([a, b], dst)
    df = results.load_results("lm_step", dst)
    assert sorted(df["size"]) == ["large", "small"]
    meta = results.load_metadata("lm_step", dst)
    assert len(meta["sources"]) == 2 and all("gpu" in m for m in meta["sources"])
    assert list(results.load_results("other", dst)["x"]) == [1]


def test_integer_and_float_keys_match(tmp_path):
    base = dict(size="small", batch=4, dtype="bf16", attention="sdpa", compile=False, world_size=1, gpu="G")
    results.save_results(pd.DataFrame([{**base, "context": 512.0, "fwd_ms": 1.0}]), "lm_step", tmp_path)
    results.save_results(pd.DataFrame([{**base, "context": 512, "fwd_ms": 2.0}]), "lm_step", tmp_path)
    df = results.load_results("lm_step", tmp_path)
    assert len(df) == 1 and df["fwd_ms"].iloc[0] == 2.0
