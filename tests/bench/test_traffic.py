"""lab.bench.traffic: the bytes each sharding schedule's collectives send, counted and in closed form."""

import math

import pytest

from lab.bench import traffic


def test_closed_form_traffic_table():
    closed = traffic.closed_form_traffic("tiny", 2).set_index("impl")
    assert closed.loc["zero1", "ratio_to_ddp"] == pytest.approx(1.0, abs=1e-4)
    assert closed.loc["sharded_optimizer", "ratio_to_ddp"] == pytest.approx(1.5)
    assert closed.loc["ddp", "total_gib"] == pytest.approx(closed.loc["ddp", "total_bytes"] / 2**30)


def _zero1_fails_on_rank_one(impl, cfg):
    from lab.parallel import launcher

    if impl == "zero1" and launcher.rank() == 1:
        raise RuntimeError("injected failure in zero1")
    return traffic.traffic_row(impl, cfg)  # (the ranks' own module: not monkeypatched there)


def test_traffic_matches_the_closed_form_and_a_failing_schedule_is_a_row(monkeypatch):
    monkeypatch.setattr(traffic, "traffic_row", _zero1_fails_on_rank_one)
    df = traffic.measure_traffic("tiny", 2, 16, "cpu")
    assert list(dict.fromkeys(df["impl"])) == list(traffic.IMPLS)
    zero1 = df[df["impl"] == "zero1"]
    assert len(zero1) == 1 and zero1["status"].iloc[0] == "failed" and math.isnan(zero1["measured_bytes"].iloc[0])
    assert zero1["error"].iloc[0].startswith("rank 1 failed: RuntimeError: injected failure in zero1")
    rest = df[df["impl"] != "zero1"]
    assert (rest["status"] == "ok").all() and (rest["measured_bytes"] > 0).all()
    matched = rest.dropna(subset=["expected_bytes"])  # fsdp (measured after the failure, anew) has no closed form
    assert set(matched["impl"]) == {"ddp", "sharded_optimizer"} and set(rest["impl"]) == {"ddp", "sharded_optimizer",
                                                                                         "fsdp"}
    assert (matched["measured_bytes"] == matched["expected_bytes"]).all()
    assert rest.loc[rest["impl"] == "ddp", "measured_ratio_to_ddp"].iloc[0] == 1.0
