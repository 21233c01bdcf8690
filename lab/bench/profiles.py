"""The ``torch.profiler`` profiles of one language-model configuration, one per mode, taken on first use, and
the tables read from them: every kernel (on a CPU, every aten operator), each mode's wall and GPU-busy time,
and the naive attention's three ranges with their FLOPs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from lab.measure import profiling as prof_tables
from lab.measure.step import MODES
from lab.model import ModelConfig, config_for


def size_label(size: str | ModelConfig) -> str:
    """A size's name, or ``d<d_model>_L<layers>`` for an explicit :class:`ModelConfig`."""
    return size if isinstance(size, str) else f"d{size.d_model}_L{size.num_layers}"


class KernelProfiles:
    """The profiles of one configuration, one per mode, taken only when a table is asked for (so that a
    notebook replaying its tables never profiles). ``profile`` is :func:`lab.bench.lm.profile_lm` with the
    device and the warm-up and step counts bound (``functools.partial``). Each profile is also exported as a
    Chrome/Perfetto trace into ``trace_dir``."""

    def __init__(self, profile: Callable[..., Any], size: str | ModelConfig, context: int, batch: int,
                 trace_dir: str | Path, modes: Sequence[str] = MODES, attention: str = "naive"):
        self.profile, self.size, self.context, self.batch = profile, size, context, batch
        self.trace_dir, self.modes, self.attention = Path(trace_dir), tuple(modes), attention
        self._profiles: dict[str, Any] = {}

    def trace_path(self, mode: str) -> Path:
        """Where the Chrome/Perfetto trace of ``mode`` is written."""
        return self.trace_dir / f"01_{size_label(self.size)}_{mode}.json"

    def profiler(self, mode: str):
        """The profiler of ``mode`` (profiled now if not yet)."""
        if mode not in self._profiles:
            self._profiles[mode] = self.profile(self.size, mode=mode, context=self.context, batch=self.batch,
                                                attention=self.attention, trace_path=self.trace_path(mode))
        return self._profiles[mode]

    def kernels(self) -> pd.DataFrame:
        """Every kernel (GPU) or aten operator (CPU) of every mode: :func:`lab.measure.profiling.kernel_table`
        rows with a ``mode`` column."""
        return pd.concat([prof_tables.kernel_table(self.profiler(m), top=None).assign(mode=m) for m in self.modes],
                         ignore_index=True)

    def step_times(self) -> pd.DataFrame:
        """Per mode: the profiled step's wall time (ms), the kernels' busy time (ms; 0 on the CPU), the number of
        profiled steps, and the configuration."""
        return pd.DataFrame([dict(mode=m, wall_ms=prof_tables.step_wall_ms(self.profiler(m)),
                                  busy_ms=prof_tables.gpu_busy_ms(self.profiler(m)),
                                  profiled_steps=getattr(self.profiler(m), "lab_steps", 1),
                                  size=size_label(self.size), context=self.context, batch=self.batch,
                                  attention=self.attention) for m in self.modes])

    def attention_ranges(self) -> pd.DataFrame:
        """The naive attention's three ranges in the forward profile: calls and ms per step, GFLOP per step
        (:func:`lab.measure.profiling.attention_phase_flops`) and the TFLOP/s achieved."""
        cfg = config_for(self.size) if isinstance(self.size, str) else self.size
        flops = prof_tables.attention_phase_flops(self.batch, cfg.num_heads, self.context, cfg.head_dim,
                                                  cfg.num_layers)
        ranges = prof_tables.range_times(self.profiler("forward"))
        ranges["gflop_per_step"] = ranges["range"].map(flops) / 1e9
        ranges["tflop_per_s"] = ranges["gflop_per_step"] / ranges["ms_per_step"]
        return ranges
