"""lab.book.communication.present: the sentences and tables of notebook 06, from small synthetic grids."""

import json
import os

import matplotlib
import pandas as pd
import pytest
import torch

from lab.book.communication import collectives
from lab.book.communication import present as comm
from tests.book.prose import amounts, amounts_in_order, counts, has_amount, in_order, numbers

matplotlib.use("Agg")
MIB = 2**20


def _row(backend, op, n, size_mb, times_ms, correct=True):
    t = sorted(times_ms)[len(times_ms) // 2]
    size = size_mb * MIB
    return dict(backend=backend, op=op, world_size=n, size_mb=size_mb, size_bytes=size, correct=correct, status="ok",
                time_ms=t, time_ms_std=0.0, samples_ms=json.dumps(times_ms),
                algbw_gbps=collectives.algorithm_bandwidth_gbps(size, t / 1e3),
                busbw_gbps=collectives.bus_bandwidth_gbps(op, size, t / 1e3, n))


def _jitter(ms, k=8):
    return [ms * (1 + 0.01 * ((i * 7) % 5 - 2)) for i in range(k)]  # +-2 %, deterministic


def grid(split_factor=1.0, slow_ranks=1.0):
    """gloo, 2 and 4 ranks, 1 and 10 MiB: an all-reduce of 1 ms + 1 ms/MiB; reduce-scatter and all-gather each
    half of it times ``split_factor``; 4 ranks ``slow_ranks`` times slower than the ring factor predicts."""
    rows = []
    for n in (2, 4):
        ring = (2 * (n - 1) / n) / 1.0  # all-reduce traffic per link relative to 2 ranks
        for s in (1, 10):
            ar = (1 + s) * ring * (slow_ranks if n == 4 else 1.0)
            rows.append(_row("gloo", "all_reduce", n, s, _jitter(ar)))
            for op in ("reduce_scatter", "all_gather"):
                rows.append(_row("gloo", op, n, s, _jitter(ar / 2 * split_factor)))
    return pd.DataFrame(rows)


def test_duration_and_size_text():
    assert comm.duration(0.143) == "143 µs" and comm.duration(3.38) == "3.38 ms"
    assert comm.duration(float("nan")) == "n/a"
    assert comm.size_text(0.0625) == "64 KiB" and comm.size_text(10) == "10 MiB" and comm.size_text(1024) == "1 GiB"
    assert comm.size_text(0.999985) == "1 MiB"  # a tensor trimmed to a multiple of 6 ranks is the 1 MiB row
    assert comm.nominal_mb(0.062485) == 0.0625


def test_correctness_sentence_names_wrong_results():
    g = grid()
    ok = comm.correctness_sentence(g)
    assert numbers(ok)[0] == 12 and "Wrong" not in ok
    g.loc[4, "correct"] = False
    text = comm.correctness_sentence(g)
    assert "Wrong" in text and counts(text)[0] == (1, 12)
    assert "gloo reduce-scatter" in text and in_order(text, [2, 10])  # which call: backend, op, ranks, MiB


def test_cpu_sharing_sentence():
    g = grid()
    shared = comm.cpu_sharing_sentence(g, cores=2)
    assert numbers(shared)[:2] == [2, 4] and "gloo" in shared  # cores, then the processes sharing them
    assert numbers(comm.cpu_sharing_sentence(g, cores=8)) == [8]  # no process shared a core of the 8
    assert comm.cpu_sharing_sentence(g[g["backend"] == "nccl"], cores=2) == ""
    assert "not recorded" in comm.cpu_sharing_sentence(g, cores=None)


def test_a_replay_describes_the_machine_that_measured(tmp_path):
    """Replayed on a 2-core CPU, 06 said 'this machine has 0 GPU(s)' and '2 CPU cores' of a table measured
    on 2 H100s and 32 cores."""
    from lab.measure.results import save_results

    save_results(grid(), "collectives", tmp_path, source="06_communication")
    meta_path = tmp_path / "collectives.json"
    meta = json.loads(meta_path.read_text())
    meta["sources"]["06_communication"].update(gpu_count=2, host_cores=32)
    meta_path.write_text(json.dumps(meta))
    assert comm.measuring_machine(str(tmp_path), True) == dict(gpus=2, cores=32)
    assert comm.measuring_machine(str(tmp_path), ["collectives"]) == dict(gpus=2, cores=32)
    here = comm.measuring_machine(str(tmp_path), False)
    assert here["cores"] == os.cpu_count() and here["gpus"] == torch.cuda.device_count()
    plan = collectives.plan_grid(False, "auto", [2, 4, 6], gpus=2)
    assert list(plan.gpu_world_sizes) == [2]
    assert numbers(plan.note) == [4, 6, 2, 2] and "NCCL" in plan.note  # the sizes dropped, the GPUs, the limit


def test_split_allreduce_verdicts_follow_the_samples():
    same = comm.split_allreduce(grid(split_factor=1.0))
    assert list(same["world_size"]) == [2, 4] and (same["size_mb"] == 10).all()
    assert (same["verdict"] == "within noise").all()
    text = comm.split_allreduce_sentences(same)
    assert amounts_in_order(text, [(11, "ms"), (11, "ms"), (16.5, "ms"), (16.5, "ms")])  # split vs all-reduce
    assert text.count("within noise") == 2 and "slower" not in text and "faster" not in text
    slower = comm.split_allreduce(grid(split_factor=1.3))
    assert (slower["verdict"] == "slower").all() and slower["ratio"].iloc[0] == pytest.approx(1.3, rel=0.03)
    text = comm.split_allreduce_sentences(slower)
    assert "slower" in text and 1.3 in numbers(text)  # the split's time ratio, named as slower
    faster = comm.split_allreduce(grid(split_factor=0.7))
    text = comm.split_allreduce_sentences(faster)
    assert amounts_in_order(text, [(7.7, "ms"), (11, "ms"), (1.43, "x")]) and "faster" in text
    answer = comm.split_allreduce_answer(slower)
    assert "gloo" in answer and numbers(answer)[:2] == [2, 10] and "slower" in answer


def test_bus_bandwidth_holds_or_not():
    held = comm.bus_bandwidth_by_ranks(grid())
    assert list(held["verdict"]) == ["reference", "within noise"]
    r4 = held.set_index("world_size").loc[4]
    assert r4["busbw_gbps"] == pytest.approx(held.set_index("world_size").loc[2, "busbw_gbps"], rel=0.03)
    assert r4["algbw_gbps"] == pytest.approx(r4["busbw_gbps"] / 1.5)
    text = comm.bus_bandwidth_sentences(held)
    assert amounts(text) == [(10, "MiB"), (0.953, "GB/s"), (0.953, "GB/s")] and "within noise" in text
    assert "lower" not in text and "higher" not in text
    dropped = comm.bus_bandwidth_by_ranks(grid(slow_ranks=2.0))
    assert list(dropped["verdict"]) == ["reference", "lower"]
    text = comm.bus_bandwidth_sentences(dropped)
    assert amounts(text)[1:] == [(0.953, "GB/s"), (0.477, "GB/s")] and "lower" in text and "within noise" not in text
    answer = comm.bus_bandwidth_answer(dropped)
    assert in_order(answer, [0.953, 2, 0.477, 4]) and "lower" in answer  # GB/s on 2 ranks, on 4, the verdict
    rose = comm.bus_bandwidth_by_ranks(grid(slow_ranks=0.5))  # H100 host, gloo: 2.55 GB/s on 2 ranks, 3.52 on 4
    assert list(rose["verdict"]) == ["reference", "higher"]
    text = comm.bus_bandwidth_sentences(rose)
    assert has_amount(text, 1.91, "GB/s") and "higher" in text and "lower" not in text
    one = comm.bus_bandwidth_answer(held[held["world_size"] == 2])
    assert not amounts(one) and not any(v in one for v in ("within noise", "lower", "higher"))  # no comparison


def test_latency_bandwidth_sentences_from_a_fit():
    g = grid()
    fits = collectives.latency_bandwidth_fit(g)
    ar2 = fits[(fits["op"] == "all_reduce") & (fits["world_size"] == 2)].iloc[0]
    assert ar2["latency_ms"] == pytest.approx(1.0, rel=0.05)  # 1 ms + 1 ms per MiB
    text = comm.latency_bandwidth_sentences(fits)
    first = text.split("\n\n")[0]  # one paragraph per backend and world size
    latency, bandwidth = float(f"{ar2['latency_ms']:.3g}"), float(f"{ar2['bandwidth_gbps']:.3g}")
    assert "gloo" in first and numbers(first)[0] == 2  # backend, ranks
    assert amounts(first) == [(latency, "ms"), (bandwidth, "GB/s"), (1, "MiB")]  # latency, bandwidth, crossover
    answer = comm.latency_bandwidth_answer(fits)
    assert "gloo" in answer and numbers(answer)[0] == 2
    assert amounts(answer)[:2] == [(latency, "ms"), (bandwidth, "GB/s")]
    flat = comm.latency_bandwidth_sentences(fits.assign(bandwidth_gbps=float("nan")))
    assert not [a for a in amounts(flat) if a[1] == "GB/s"] and "bandwidth" in flat  # no bandwidth, and says so


def test_backend_sentence_needs_both_backends():
    g = grid()
    alone = comm.backend_sentence(g)
    assert numbers(alone) == [2] and "gloo" in alone and "NCCL" in alone and "faster" not in alone
    fast = g.assign(backend="nccl", samples_ms=[json.dumps([t / 50 for t in json.loads(s)]) for s in g["samples_ms"]])
    text = comm.backend_sentence(pd.concat([g, fast]))
    assert numbers(text)[:3] == [10, 2, 50] and "faster" in text.split(".")[0]  # size, ranks, speedup


def test_plots_draw_from_the_grid():
    g = grid()
    fig = comm.plot_times_with_fit(g, collectives.latency_bandwidth_fit(g))
    (ax,) = fig.axes
    assert ax.get_title() == "gloo: all-reduce" and len(ax.lines) >= 2
    assert comm.plot_bandwidth(g).axes.size == 1
    assert list(comm.grid_table(g).columns) == comm.GRID_COLUMNS
