"""The ring simulator computes the right values and its costs match lab.accounting's closed forms."""

import numpy as np
import pytest

from lab import accounting as acc
from lab.accounting.ring_sim import RingSimulator, expected_result, simulate

COLLECTIVES = ["all_gather", "reduce_scatter", "all_reduce", "alternate_all_reduce"]


def _int_arrays(collective, n, length, seed=0):
    # integers: every summation order gives exactly the same answer, so values can be compared with ==
    rng = np.random.default_rng(seed)
    size = length // n if collective == "all_gather" else length
    return [rng.integers(-1000, 1000, size=size, dtype=np.int64) for _ in range(n)]


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_values_exact(collective, n):
    arrays = _int_arrays(collective, n, length=24 * n)
    result = RingSimulator(n, bandwidth=1.0).run(collective, arrays)
    want = expected_result(collective, arrays)
    assert len(result.outputs) == n
    for got, ref in zip(result.outputs, want):
        np.testing.assert_array_equal(got, ref)


def test_values_by_hand():
    # 3 devices, reduce-scatter of [1,2,3], [10,20,30], [100,200,300]: device i owns element i of the sum
    arrays = [np.array([1, 2, 3]), np.array([10, 20, 30]), np.array([100, 200, 300])]
    rs = RingSimulator(3, 1.0).reduce_scatter(arrays)
    assert [o.tolist() for o in rs.outputs] == [[111], [222], [333]]
    ag = RingSimulator(3, 1.0).all_gather([np.array([1]), np.array([2]), np.array([3])])
    assert all(o.tolist() == [1, 2, 3] for o in ag.outputs)
    ar = RingSimulator(3, 1.0).alternate_all_reduce(arrays)
    assert all(o.tolist() == [111, 222, 333] for o in ar.outputs)


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("size_bytes", [8 * 24, 8 * 240, 8 * 4800])
def test_bytes_and_time_match_closed_forms(collective, n, size_bytes):
    bandwidth = 3.0e9
    result = simulate(collective, size_bytes, n, bandwidth)  # also checks the values
    want_bytes = acc.as_float(acc.collective_bytes(collective), S=size_bytes, N=n)
    want_time = acc.as_float(acc.collective_time(collective), S=size_bytes, N=n, W=bandwidth)
    # every device sends the same amount on a ring
    assert result.bytes_sent.tolist() == [want_bytes] * n
    assert result.time_s == pytest.approx(want_time, rel=1e-12)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_latency_is_paid_once_per_step(collective):
    n, size_bytes, bandwidth, latency = 4, 8 * 64, 1e6, 2e-5
    result = simulate(collective, size_bytes, n, bandwidth, latency=latency)
    without = simulate(collective, size_bytes, n, bandwidth)
    steps = {"all_gather": n - 1, "reduce_scatter": n - 1, "all_reduce": 2 * (n - 1),
             "alternate_all_reduce": n - 1}[collective]
    assert result.steps == steps
    assert result.time_s == pytest.approx(without.time_s + steps * latency, rel=1e-12)
    assert result.time_s == pytest.approx(
        acc.as_float(acc.collective_time(collective, alpha=latency), S=size_bytes, N=n, W=bandwidth), rel=1e-12)


def test_hand_computed_numbers():
    # S = 800 bytes (100 float64), N = 4, W = 100 bytes/s:
    #   all-gather / reduce-scatter: 3 steps x 200 bytes = 600 bytes, 6 s
    #   all-reduce: 6 steps x 200 bytes = 1200 bytes, 12 s
    #   alternate all-reduce: 3 steps x 800 bytes = 2400 bytes, 24 s
    for name, sent, seconds in [("all_gather", 600, 6.0), ("reduce_scatter", 600, 6.0),
                                ("all_reduce", 1200, 12.0), ("alternate_all_reduce", 2400, 24.0)]:
        r = simulate(name, 800, 4, 100.0)
        assert r.max_bytes_sent == sent
        assert r.time_s == pytest.approx(seconds)


def test_uneven_chunks_cost_the_largest_chunk():
    # 10 elements over 4 devices: chunks of 3, 3, 2, 2; each step waits for its largest message (3 x 8 B)
    arrays = [np.arange(10, dtype=np.float64) * (i + 1) for i in range(4)]
    r = RingSimulator(4, bandwidth=8.0).reduce_scatter(arrays)
    for got, want in zip(r.outputs, np.array_split(np.sum(arrays, axis=0), 4)):
        np.testing.assert_array_equal(got, want)
    assert r.step_bytes == [24, 24, 24]
    assert r.time_s == pytest.approx(9.0)


def test_bad_input():
    with pytest.raises(ValueError, match="positive integer"):
        RingSimulator(0, 1.0)
    with pytest.raises(ValueError, match="bandwidth"):
        RingSimulator(2, 0.0)
    with pytest.raises(ValueError, match="one array per device"):
        RingSimulator(3, 1.0).all_reduce([np.zeros(3)] * 2)
    with pytest.raises(ValueError, match="same shape"):
        RingSimulator(2, 1.0).all_reduce([np.zeros(3), np.zeros(4)])
    with pytest.raises(ValueError, match="unknown collective"):
        RingSimulator(2, 1.0).run("broadcast", [np.zeros(2)] * 2)
    with pytest.raises(ValueError, match="equal shards"):
        simulate("all_gather", 8 * 10, 4, 1.0)
