"""A step-by-step simulator of ring collectives, to check the closed forms of :mod:`lab.accounting`.

``N`` simulated devices sit on a ring; device ``i`` sends only to device ``(i + 1) % N``. Every device's
link sends ``W`` bytes per second, all devices step together (synchronously), and a step lasts as long as
its largest message takes: ``latency + max_bytes / W``. The simulator moves real numpy arrays, so it
checks both *what* the collective computes (the sum for reduce-scatter and all-reduce, the concatenation
for all-gather) and *what it costs* (bytes each device sent, steps, total time).

Conventions (the same as :mod:`lab.accounting`): ``S`` is the size in bytes of the *full* array. In an
all-gather each device starts with one ``S/N`` shard and ends with all ``S`` bytes; in a reduce-scatter each
device starts with ``S`` bytes and ends with the reduced ``S/N`` shard it owns; in an all-reduce each
device starts and ends with ``S`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lab import accounting as accounting


@dataclass
class RingResult:
    """What one simulated collective produced and cost.

    ``outputs[i]`` is device ``i``'s result; ``bytes_sent[i]`` the bytes device ``i`` put on its link;
    ``time_s`` the simulated seconds; ``steps`` the number of synchronous steps; ``step_bytes[s]`` the
    largest message of step ``s`` (which sets that step's duration).
    """

    collective: str
    outputs: list[np.ndarray]
    bytes_sent: np.ndarray
    time_s: float
    steps: int
    step_bytes: list[int] = field(default_factory=list)

    @property
    def max_bytes_sent(self) -> int:
        """Bytes sent by the busiest device (the one that bounds the time)."""
        return int(self.bytes_sent.max())


class RingSimulator:
    """``n_devices`` on a unidirectional ring, each link sending ``bandwidth`` bytes/s after ``latency`` s.

    Use :meth:`all_gather`, :meth:`reduce_scatter`, :meth:`all_reduce` and :meth:`alternate_all_reduce`;
    each takes one numpy array per device and returns a :class:`RingResult`.
    """

    def __init__(self, n_devices: int, bandwidth: float, latency: float = 0.0):
        if int(n_devices) != n_devices or n_devices < 1:
            raise ValueError(f"n_devices must be a positive integer, got {n_devices!r}")
        if not bandwidth > 0:
            raise ValueError(f"bandwidth (bytes/s per device) must be positive, got {bandwidth!r}")
        if latency < 0:
            raise ValueError(f"latency must be non-negative, got {latency!r}")
        self.n = int(n_devices)
        self.bandwidth = float(bandwidth)
        self.latency = float(latency)

    # -- the one primitive: every device sends one message to its right-hand neighbour ------------------

    def _step(self, messages: list[np.ndarray], sent: np.ndarray, step_bytes: list[int]) -> list[np.ndarray]:
        """Device ``i`` sends ``messages[i]`` to ``i + 1``; returns what each device received."""
        sizes = [m.nbytes for m in messages]
        for i, size in enumerate(sizes):
            sent[i] += size
        step_bytes.append(max(sizes))
        # copies, so that a receiver never aliases the sender's buffer
        return [messages[(i - 1) % self.n].copy() for i in range(self.n)]

    def _time(self, step_bytes: list[int]) -> float:
        return float(sum(self.latency + b / self.bandwidth for b in step_bytes))

    def _check(self, arrays: list[np.ndarray], same_shape: bool = True) -> list[np.ndarray]:
        if len(arrays) != self.n:
            raise ValueError(f"expected one array per device ({self.n}), got {len(arrays)}")
        arrays = [np.asarray(a) for a in arrays]
        if any(a.ndim != 1 for a in arrays):
            raise ValueError("the simulator works on 1-D arrays (flatten first)")
        if same_shape and len({a.shape for a in arrays}) != 1:
            raise ValueError(f"every device must hold an array of the same shape, got {[a.shape for a in arrays]}")
        if len({a.dtype for a in arrays}) != 1:
            raise ValueError("every device must hold the same dtype")
        return arrays

    # -- collectives -----------------------------------------------------------------------------------

    def all_gather(self, shards: list[np.ndarray]) -> RingResult:
        """Ring all-gather: device ``i`` starts with shard ``i``; all end with the concatenation of all shards.

        In step ``s`` (``s = 0 .. N-2``) device ``i`` forwards shard ``(i - s) mod N``: the one it owns at
        ``s = 0``, afterwards the one it just received. ``N - 1`` steps of one shard each.
        """
        shards = self._check(shards, same_shape=False)
        held = [{i: shards[i].copy()} for i in range(self.n)]
        sent, step_bytes = np.zeros(self.n, dtype=np.int64), []
        for s in range(self.n - 1):
            idx = [(i - s) % self.n for i in range(self.n)]
            received = self._step([held[i][idx[i]] for i in range(self.n)], sent, step_bytes)
            for i in range(self.n):
                held[i][idx[(i - 1) % self.n]] = received[i]
        outputs = [np.concatenate([held[i][j] for j in range(self.n)]) for i in range(self.n)]
        return RingResult("all_gather", outputs, sent, self._time(step_bytes), len(step_bytes), step_bytes)

    def reduce_scatter(self, arrays: list[np.ndarray]) -> RingResult:
        """Ring reduce-scatter: every device starts with a full array; device ``i`` ends with chunk ``i`` of the sum.

        Arrays are split into ``N`` chunks (``np.array_split``: equal when ``N`` divides the length). In step
        ``s`` device ``i`` sends its running partial sum of chunk ``(i - s - 1) mod N``; the receiver adds its
        own copy of that chunk. After ``N - 1`` steps the partial sum that reaches device ``i`` for chunk
        ``i`` contains every device's contribution.
        """
        arrays = self._check(arrays)
        partial = [np.array_split(a.copy(), self.n) for a in arrays]
        sent, step_bytes = np.zeros(self.n, dtype=np.int64), []
        for s in range(self.n - 1):
            idx = [(i - s - 1) % self.n for i in range(self.n)]
            received = self._step([partial[i][idx[i]] for i in range(self.n)], sent, step_bytes)
            for i in range(self.n):
                chunk = idx[(i - 1) % self.n]
                partial[i][chunk] = partial[i][chunk] + received[i]
        outputs = [partial[i][i] for i in range(self.n)]
        return RingResult("reduce_scatter", outputs, sent, self._time(step_bytes), len(step_bytes), step_bytes)

    def all_reduce(self, arrays: list[np.ndarray]) -> RingResult:
        """Bandwidth-optimal ring all-reduce = reduce-scatter, then all-gather of the reduced chunks.

        ``2 (N - 1)`` steps of ``S/N`` bytes each.
        """
        rs = self.reduce_scatter(arrays)
        ag = self.all_gather(rs.outputs)
        return RingResult("all_reduce", ag.outputs, rs.bytes_sent + ag.bytes_sent, rs.time_s + ag.time_s,
                          rs.steps + ag.steps, rs.step_bytes + ag.step_bytes)

    def alternate_all_reduce(self, arrays: list[np.ndarray]) -> RingResult:
        """The *alternate* (naive) ring all-reduce: whole arrays travel round the ring, no chunking.

        In step ``s`` device ``i`` forwards the full array that originated at device ``(i - s) mod N`` (its own
        at ``s = 0``, afterwards the one it just received) and adds every array it receives to its running
        sum. After ``N - 1`` steps each device has seen all ``N`` arrays and holds their sum. ``N - 1`` steps of
        ``S`` bytes each: ``N/2`` times the traffic of :meth:`all_reduce`, equal only at ``N = 2``.
        """
        arrays = self._check(arrays)
        total = [a.copy() for a in arrays]
        travelling = [a.copy() for a in arrays]
        sent, step_bytes = np.zeros(self.n, dtype=np.int64), []
        for _ in range(self.n - 1):
            travelling = self._step(travelling, sent, step_bytes)
            for i in range(self.n):
                total[i] = total[i] + travelling[i]
        return RingResult("alternate_all_reduce", total, sent, self._time(step_bytes), len(step_bytes),
                          step_bytes)

    def run(self, collective: str, arrays: list[np.ndarray]) -> RingResult:
        """Run a collective by name: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``alternate_all_reduce``."""
        fns = {"all_gather": self.all_gather, "reduce_scatter": self.reduce_scatter,
               "all_reduce": self.all_reduce, "alternate_all_reduce": self.alternate_all_reduce}
        if collective not in fns:
            raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(fns)}")
        return fns[collective](arrays)


def expected_result(collective: str, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The reference answer each device should end with (computed directly, without a ring)."""
    n = len(arrays)
    if collective == "all_gather":
        return [np.concatenate(arrays)] * n
    total = np.sum(np.stack(arrays), axis=0)
    if collective == "reduce_scatter":
        return np.array_split(total, n)
    if collective in ("all_reduce", "alternate_all_reduce"):
        return [total] * n
    raise ValueError(f"unknown collective {collective!r}")


def simulate(collective: str, size_bytes: int, n_devices: int, bandwidth: float, latency: float = 0.0,
             dtype=np.float64, seed: int = 0) -> RingResult:
    """Simulate ``collective`` on random data whose *full* array is ``size_bytes`` bytes; verifies the values.

    ``size_bytes`` is ``S`` in :mod:`lab.accounting`'s convention (the all-gathered result, or the array
    each device reduces). Raises ``AssertionError`` if a device ends with a wrong result; returns the
    :class:`RingResult` (bytes sent per device, simulated time in seconds).
    """
    itemsize = np.dtype(dtype).itemsize
    if size_bytes % itemsize:
        raise ValueError(f"size_bytes={size_bytes} is not a whole number of {np.dtype(dtype)} elements")
    length = size_bytes // itemsize
    rng = np.random.default_rng(seed)
    if collective == "all_gather":
        if length % n_devices:
            raise ValueError(f"{length} elements do not split into {n_devices} equal shards")
        arrays = [rng.standard_normal(length // n_devices).astype(dtype) for _ in range(n_devices)]
    else:
        arrays = [rng.standard_normal(length).astype(dtype) for _ in range(n_devices)]
    result = RingSimulator(n_devices, bandwidth, latency).run(collective, arrays)
    for got, want in zip(result.outputs, expected_result(collective, arrays)):
        # sums are accumulated in a different order on each device: equal up to rounding
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    return result


def check_closed_forms(sizes_bytes, devices, bandwidth: float, latency: float = 0.0):
    """Simulate every collective for each ``S`` in ``sizes_bytes`` and ``N`` in ``devices`` and set the
    result next to :mod:`lab.accounting`'s closed forms.

    Returns a DataFrame with ``collective``, ``devices``, ``size_bytes``, ``simulated_bytes`` (busiest
    device), ``predicted_bytes``, ``simulated_s``, ``predicted_s``, ``steps`` and ``match`` (bytes equal
    and times equal to 1e-12 relative). Values are verified by :func:`simulate` on the way.
    """
    import pandas as pd

    rows = []
    for collective in accounting.COLLECTIVES:
        for n in devices:
            for size in sizes_bytes:
                r = simulate(collective, size, n, bandwidth, latency)
                want_bytes = accounting.as_float(accounting.collective_bytes(collective), S=size, N=n)
                want_s = accounting.as_float(accounting.collective_time(collective, alpha=latency),
                                             S=size, N=n, W=bandwidth)
                rows.append(dict(collective=collective, devices=n, size_bytes=size,
                                 simulated_bytes=r.max_bytes_sent, predicted_bytes=want_bytes,
                                 simulated_s=r.time_s, predicted_s=want_s, steps=r.steps,
                                 match=bool(r.max_bytes_sent == want_bytes
                                            and abs(r.time_s - want_s) <= 1e-12 * max(want_s, 1e-300))))
    return pd.DataFrame(rows)
