"""Interleaved A/B timing of pairs of sharding implementations (GPU diagnostic), on top of the book's own
protocol: :func:`lab.bench.sharding.step_times` with :class:`lab.bench.interleaved.Interleaving`.

Both implementations of a pair live in the same processes and take turns step by step when both models
fit (otherwise they are rebuilt for each turn), the order rotated every round, ranks aligned by a barrier
before every step, so both see the same host conditions. Prints each one's median and spread over rounds
and the verdict of A against B (:func:`lab.bench.interleaved.compare_rounds`: the per-round ratios, paired).

    PYTHONPATH=. NCCL_NVLS_ENABLE=0 python tools/ab_interleaved.py        # two GPUs
    PYTHONPATH=. python tools/ab_interleaved.py cpu                        # smoke test, tiny model, gloo
"""
import sys
import time

from lab.bench.interleaved import Interleaving, compare_rounds, samples
from lab.bench.sharding import step_times

PAIRS = [("xl", "fsdp", "torch_fsdp2"), ("2.7B", "fsdp", "torch_fsdp2"), ("2.7B", "zero1", "torch_zero")]


def main(device: str = "cuda") -> None:
    pairs = PAIRS if device == "cuda" else [("tiny", a, b) for _, a, b in PAIRS]  # CPU: a smoke test
    plan = Interleaving(rounds=10, steps_per_round=1, warmup=3, schedule="auto")
    for size, a, b in pairs:
        start = time.time()
        df = step_times((a, b), size, world_size=2, context=512 if device == "cuda" else 64, batch=2, dtype="bf16",
                        interleaving=plan, device=device).set_index("impl")
        print(f"== {size}: {a} vs {b} ({time.time() - start:.0f} s, {df['schedule'].iloc[0]})")
        for impl in (a, b):
            r = df.loc[impl]
            print(f"{impl:>12}: {r['status']}, median {r['step_ms']:7.1f} ms, IQR {r['step_iqr_ms']:.1f} ms, "
                  f"rounds {[round(x) for x in samples(r['step_samples_ms'])]}")
        if (df["status"] == "ok").all():
            c = compare_rounds(samples(df.loc[a, "step_samples_ms"]), samples(df.loc[b, "step_samples_ms"]))
            print("   " + c.describe(a, b) + " (per-round ratios, paired)")
        sys.stdout.flush()


if __name__ == "__main__":
    main(*sys.argv[1:])
