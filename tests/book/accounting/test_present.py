"""lab.book.accounting.present: the 09 notebook's equations, claims, plots and the reading of other notebooks'
results, from small synthetic tables. Claims are checked by their numbers, never their wording."""

import matplotlib
import pandas as pd
import pytest

import lab.accounting as acc
from lab.bench.predicted_memory import predicted_vs_measured
from lab.book import claims as cl
from lab.book.accounting import present as ab
from lab.book.report import Chapter
from lab.measure import results as store

matplotlib.use("Agg")

GiB = 2**30


def values(claim) -> list[float]:
    """The numbers of a claim's findings, in order (a share as its fraction)."""
    return [f.measured.median if isinstance(f, cl.Value) else f.fraction for f in claim.findings
            if isinstance(f, (cl.Value, cl.Share))]


def test_equations_are_latex_of_the_closed_forms(capsys):
    assert ab.show_equation("x", 2) == "x = 2"
    assert "$$x = 2$$" in capsys.readouterr().out  # plain Python: printed, not displayed
    collectives = ab.show_collective_equations()
    assert len(collectives) == 5 and collectives[-1].endswith(r"= \frac{N}{2}")
    table = ab.ffn_cost_table(3)
    assert table.loc[(table.strategy == "dp") & (table.phase == "train"), "flops_per_device"].item() == \
        r"$\frac{18 B D F}{N}$"


def test_language_model_claims_and_figure():
    memory = pd.DataFrame([dict(size="big", precision=p, params_gib=a, grads_gib=a, optimizer_gib=2 * a,
                                weight_copies_gib=w, activations_gib=act, total_gib=4 * a + w + act)
                           for p, a, w, act in [("fp32", 10, 0, 20), ("bf16_autocast", 10, 5, 12), ("bf16", 5, 0, 10)]])
    # fp32 total, its share of saved activations; autocast's total, activations saved, copies added; pure bf16
    assert values(ab.memory_claim(memory)) == [60 * GiB, pytest.approx(1 / 3), 57 * GiB, 8 * GiB, 5 * GiB, 30 * GiB]
    assert len(ab.memory_figure(memory, 4, 512).axes) == 3
    flops = pd.DataFrame(dict(size=["a", "b"], attention_share=[0.02, 0.07]))
    assert values(ab.flops_claim(flops)) == [0.07, 0.02]  # the largest share first


def test_collective_and_simulator_claims():
    coll = acc.collective_table(1e9, [2, 4, 64], 450e9)
    # all-reduce on 2 and 64 devices, its limit 2S/W, the alternate ring on 64 and its ratio (ms)
    assert values(ab.collectives_claim(coll)) == pytest.approx([2.2222, 4.375, 4.4444, 140.0, 32.0], rel=1e-4)
    pivot = ab.collectives_pivot(coll, devices=(2, 64))
    assert pivot["devices"].tolist() == ["2", "64"] and pivot["all_reduce"].iloc[0] == pytest.approx(2.2222, 1e-4)
    assert ab.collectives_figure(coll).axes[0].get_yscale() == "log"
    sim = pd.DataFrame(dict(devices=[2, 4], size_bytes=[8, 8], match=[True, False]))
    claim = ab.simulator_claim(sim)
    assert values(claim) == [2, 1] and claim.because == ""  # one of two agrees: no word about the values


def test_limits_and_sweep_claims():
    limits = acc.ffn_limits_table(65536, 989e12, 450e9, 3)
    # the largest whole number of devices that stays compute bound (45.7 -> 45 for DP)
    assert values(ab.limits_claim(limits)) == [45, 30, 55, 1710, 449]
    sweep = acc.ffn_sweep_table(65536, 989e12, 450e9, devices=(2, 64), matrices=3)
    fsdp_over, fsdp_serial, tp_over, tp_serial = values(ab.ffn_sweep_claim(sweep))
    assert (round(fsdp_over, 2), round(fsdp_serial, 2), round(tp_over, 2), round(tp_serial, 2)) == (
        0.47, 0.32, 0.87, 0.46)
    assert ab.ffn_sweep_figure(sweep, 65536) is not None
    check = pd.DataFrame(dict(match=[True, True, False]))
    assert values(ab.saved_check_claim(check)) == [3, 2]


# ---------------------------------------------------------------------------------------------- measured results


def _lm_rows():
    return pd.DataFrame([dict(size="small", context=128, batch=4, dtype="fp32", attention="sdpa", compile=False,
                              world_size=1, fwd_ms=1.0, fwdbwd_ms=2.0, step_ms=3.0, fwd_peak_gib=1.0,
                              fwdbwd_peak_gib=2.0, step_peak_gib=3.9, status="ok")])


def test_measured_results_absent_other_source_and_present(tmp_path, capsys):
    book = Chapter("09_accounting", {}, str(tmp_path))
    assert ab.measured_results(book, "lm_step", "01_profiling") is None
    store.save_results(_lm_rows(), "lm_step", str(tmp_path), source="04_attention")
    assert ab.measured_results(book, "lm_step", "01_profiling") is None
    assert capsys.readouterr().out.count("01_profiling") >= 2  # the source it lacks, each time
    store.save_results(_lm_rows(), "lm_step", str(tmp_path), source="01_profiling")
    df = ab.measured_results(book, "lm_step", "01_profiling")
    assert len(df) == 1 and (df["source"] == "01_profiling").all()
    assert "commit" in capsys.readouterr().out  # the machine and commit that measured it
    old = tmp_path / "old"
    store.save_results(_lm_rows().drop(columns=["step_peak_gib"]), "lm_step", str(old), source="01_profiling")
    assert ab.measured_results(Chapter("09_accounting", {}, str(old)), "lm_step", "01_profiling") is None


def _check():
    return pd.DataFrame(dict(table=["lm_step", "lm_step", "sharding_benchmark"], impl=["forward", "train_step", "ddp"],
                             gpu=["NVIDIA H100 80GB HBM3"] * 2 + ["NVIDIA H200"], commit=["a" * 40] * 2 + ["b" * 40],
                             size="small", context=128, batch=4, dtype="fp32", world_size=[1, 1, 2],
                             predicted_gib=[1.0, 4.0, 2.0], measured_gib=[1.1, 2.0, 2.0], ratio=[1.1, 0.5, 1.0]))


def test_memory_check_claim_names_who_measured_each_table():
    claim = ab.memory_check_claim(_check())
    seen = [f.seen for f in claim.findings if isinstance(f, cl.Observed)]
    assert seen == [f"NVIDIA H100 80GB HBM3 at commit {'a' * 12}", f"NVIDIA H200 at commit {'b' * 12}"]
    # per table: peaks compared; measured / predicted lowest, median, highest
    assert values(claim) == [2, 0.5, pytest.approx(0.8), 1.1, 1, 1.0, 1.0, 1.0]
    assert ab.memory_check_display(_check(), furthest=1)["impl"].tolist() == ["train_step"]  # 0.5: furthest off
    assert ab.memory_check_figure(_check()) is not None
    empty = ab.memory_check_claim(pd.DataFrame())
    assert empty.findings == () and "CPU" in empty.because
    assert ab.memory_check_figure(pd.DataFrame()) is None and ab.memory_check_display(pd.DataFrame()).empty
    assert not cl.machine_phrases(cl.sentence(claim))


def test_memory_check_keeps_the_measuring_gpu_and_is_saved_unless_replaying(tmp_path):
    sharding = pd.DataFrame([dict(impl="ddp", world_size=2, size="small", context=128, batch=4, dtype="fp32",
                                  peak_init_gib=0.5, peak_before_step_gib=2.0, peak_after_step_gib=2.5, status="ok",
                                  gpu="NVIDIA H200", commit="b" * 40)])
    book = Chapter("09_accounting", {"quick": True}, str(tmp_path))
    ab.save_memory_check(book, predicted_vs_measured(None, sharding))
    saved = store.load_results("accounting_memory_check", str(tmp_path), source="09_accounting")
    assert saved["gpu"].tolist() == ["NVIDIA H200"] and saved["commit"].tolist() == ["b" * 40]
    ab.save_memory_check(book, pd.DataFrame())  # an empty comparison replaces the older one
    assert store.load_results("accounting_memory_check", str(tmp_path)).empty
    replaying = Chapter("09_accounting", {}, str(tmp_path / "other"), replay=True)
    ab.save_memory_check(replaying, _check())
    assert not (tmp_path / "other").exists()
