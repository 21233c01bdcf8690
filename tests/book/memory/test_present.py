"""lab.book.memory.present: the 03 notebook's sentences, tables and plots, from small synthetic inputs."""

import math

import matplotlib
import pandas as pd

matplotlib.use("Agg")

from lab.book.memory import present as mb  # noqa: E402
from lab.book.memory.workload import MemorySetup  # noqa: E402
from lab.model import ModelConfig  # noqa: E402
from tests.book.prose import amounts, clause_of, in_order, numbers, sentence_with, sentences  # noqa: E402

MiB, GiB = 2**20, 2**30


SETUP = MemorySetup(size="toy", model=ModelConfig(d_model=64, d_ff=256, num_layers=4, num_heads=4, context_length=64,
                                                  vocab_size=1000), batch=4, timeline_context=64, block_context=64,
                    checkpoint_context=64, peak_contexts=(32, 64))


def _phases():
    rows = [("forward", "forward 1", 2.0, 1.0, 1.8), ("forward", "after forward", 1.8, 1.8, 1.0),
            ("train_step", "forward 1", 2.0, 1.0, 1.8), ("train_step", "backward 1", 2.2, 1.8, 1.4),
            ("train_step", "optimizer_step 1", 2.5, 1.4, 1.5), ("train_step", "forward 2", 2.5, 1.5, 2.3),
            ("train_step", "backward 2", 2.7, 2.3, 1.9), ("train_step", "optimizer_step 2", 2.5, 1.9, 1.5)]
    return pd.DataFrame(rows, columns=["recording", "phase", "peak_gib", "start_gib", "end_gib"])


def test_timeline_sentences_name_each_peak():
    phases = _phases()
    text = mb.timeline_sentences(phases, parameter_bytes=0.25 * GiB)
    assert in_order(sentence_with(text, "forward 1"), [2, 819])  # the forward's peak (GiB), built up (MiB)
    assert in_order(sentence_with(text, "backward 2"), [2.7])
    # optimizer state = end of optimizer step 1 - start of forward 1 = 0.5 GiB; expected 2 x 0.25 GiB
    assert in_order(sentence_with(text, "expected"), [512, 512])
    assert in_order(text[text.index("After step 2"):], [2, 0])  # no growth after the second step
    answer = mb.timeline_answer(phases)
    assert "`forward 1`" in answer and "`backward 2`" in answer and numbers(answer) == [1, 2, 2, 2.7]
    assert mb.phase_peaks_display(phases, "train_step")["phase"].iloc[2] == "optimizer step 1"


def test_residual_and_largest_allocation_sentences():
    residual = pd.DataFrame(dict(context=[64], batch=[4], d_model=[64], num_layers=[4], residual_bytes=[65536]))
    text = mb.residual_sentence(residual, SETUP)
    assert in_order(text, [4, 64, 64, 4, 64, 0.0625, 4, 256])  # B x T x D x 4 bytes = 64 KiB; 4 blocks: 256 KiB
    largest = pd.DataFrame(dict(size_mib=[0.977, 0.25], origin=["head.py:1:f", "ffn.py:2:g"]))
    origins = pd.DataFrame(dict(origin=["ffn.py:2:g"], count=[8], total_mib=[2.0], share=[0.5]))
    text = mb.largest_allocations_sentence(largest, origins, SETUP)
    # logits 4 x 64 x 1000 x 4 B = 0.9766 MiB; FFN hidden 4 x 64 x 256 x 4 B = 0.25 MiB
    assert in_order(sentence_with(text, "logits"), [0.9766])
    assert in_order(text, [0.25, 4]) and in_order(text, [8, 2, 50])  # FFN hidden, x residual; the top origin
    answer = mb.largest_allocations_answer(largest, origins)
    assert numbers(answer)[0] == 0.977 and "head.py:1:f" in answer


def _peaks():
    rows = [("forward", 128, "fp32", 10.0, "ok"), ("forward", 128, "bf16", 12.0, "ok"),
            ("forward", 2048, "fp32", 40.0, "ok"), ("forward", 2048, "bf16", 30.0, "ok"),
            ("train_step", 128, "fp32", 50.0, "ok"), ("train_step", 128, "bf16", 50.0, "ok"),
            ("train_step", 2048, "fp32", math.nan, "oom"), ("train_step", 2048, "bf16", 90.0, "ok")]
    return pd.DataFrame(rows, columns=["mode", "context", "dtype", "peak_gib", "status"])


def test_peak_pivot_and_mixed_precision_sentence():
    pivot = mb.peak_pivot(_peaks())
    assert pivot.columns.tolist() == ["mode", "context", "bf16", "fp32"]
    assert pivot.loc[(pivot["mode"] == "train_step") & (pivot["context"] == 2048), "fp32"].item() == "OOM"
    text = mb.mixed_precision_sentence(_peaks())
    assert in_order(text, [-25.0, 20.0])  # the range of changes
    assert in_order(text, [20.0, 128, 10, 12, -25.0, 2048, 40, 30])  # forward: per context, fp32 -> bf16 GiB
    assert in_order(text, [0.0, 128])  # the training step at 128: no change
    assert "*more*" in text  # a positive change is named as more memory
    oom = text[text.index("Out of memory"):]
    assert "train_step" in oom and numbers(oom) == [2048] and "fp32" in oom
    answer = mb.mixed_precision_answer(_peaks())
    assert numbers(answer)[:2] == [-25.0, 2048]


def test_saved_tensor_sentences():
    ops = pd.DataFrame(dict(op=["Mul", "Mm", "Silu"], bytes=[6 * MiB, 3 * MiB, 1 * MiB], share=[0.6, 0.3, 0.1],
                            batch=4, context=64, dtype="fp32", input_bytes=1 * MiB))
    text = mb.block_saved_sentence(ops, top=2)
    assert in_order(text, [10, 10.0, 6, 60, 3, 30, 90]) and text.index("`Mul`") < text.index("`Mm`")
    norm = pd.DataFrame(dict(rmsnorm=["eager", "compiled"], saved_bytes=[2 * MiB, MiB], saved_inputs=[2.0, 1.0]))
    assert in_order(mb.rmsnorm_sentence(norm), [2, 2.0, 1, 1.0])  # eager then compiled: MiB, x the input
    assert "not measured" in mb.rmsnorm_sentence(norm.iloc[:1])
    answer = mb.saved_tensors_answer(ops, norm)
    assert numbers(answer) == [10, 10.0, 60, 2.0, 1.0] and "`Mul`" in answer


def test_gradient_sentence_and_figure():
    grads = pd.DataFrame(dict(block=[0, 1, 2], measured_bytes=[3 * MiB, MiB, MiB], expected_bytes=[MiB] * 3,
                              measured_mib=[3.0, 1.0, 1.0], expected_mib=[1.0] * 3, ratio=[3.0, 1.0, 1.0]))
    text = mb.gradients_sentence(grads, embedding_bytes=2 * MiB)
    assert in_order(text, [1, 2, 1, 1.0])  # blocks 1-2 leave 1 MiB each, median ratio 1
    assert in_order(text, [0, 3, 2, 2])  # block 0: 3 MiB, 2 more than its parameters: the embedding's 2 MiB
    assert numbers(mb.gradients_answer(grads))[:2] == [1, 1.0]
    fig = mb.gradients_figure(grads)
    assert [p.get_height() for p in fig.axes[0].patches] == [3.0, 1.0, 1.0]


def _sweep():
    rows = [("none", math.nan, 60.0, 1000.0, "ok"), ("single", 1, 40.0, 1400.0, "ok"),
            ("single", 2, 41.0, 1350.0, "ok"), ("single", 4, 45.0, 1300.0, "ok"), ("single", 8, math.nan,
                                                                                  math.nan, "oom"),
            ("nested", math.nan, 40.2, 2000.0, "ok")]
    return pd.DataFrame(rows, columns=["strategy", "group_size", "peak_gib", "step_ms", "status"])


def test_best_group_and_its_neighbours():
    b = mb.best_group(_sweep())
    assert b["best"]["group_size"] == 1 and b["smaller"] is None and b["larger"]["group_size"] == 2
    middle = _sweep()
    middle.loc[2, "peak_gib"] = 39.0
    b = mb.best_group(middle)
    assert (b["smaller"]["group_size"], b["best"]["group_size"], b["larger"]["group_size"]) == (1, 2, 4)
    oom_neighbour = _sweep()
    oom_neighbour.loc[3, "peak_gib"] = 30.0  # k = 4 best, k = 8 (its larger neighbour) out of memory
    b = mb.best_group(oom_neighbour)
    assert b["best"]["group_size"] == 4 and b["larger"]["status"] == "oom"
    assert mb.best_group(_sweep().assign(status="oom"))["best"] is None


def test_checkpoint_sentences_and_figure():
    text = mb.checkpoint_sentence(_sweep(), parameter_bytes=8 * GiB)
    best, neighbour, none, nested, nesting = sentences(text)
    assert numbers(best) == [1, 40, 1.4] and amounts(best) == [(40, "GiB"), (1.4, "s")]  # k, its peak, its step
    assert numbers(neighbour) == [2, 41, 1.35] and amounts(neighbour) == [(41, "GiB"), (1.35, "s")]
    assert amounts(none) == [(60, "GiB"), (1, "s"), (0.71, "x")] and numbers(none)[-1] == 1  # time against k = 1
    assert "nested" in nested and amounts(nested) == [(40.2, "GiB"), (2, "s"), (1.43, "x")]
    assert numbers(nesting) == [1, 2, 32] and "within" in nesting  # nested vs k = 1 within 2%; 4 x 8 GiB of state
    answer = mb.checkpoint_answer(_sweep())
    assert amounts(answer) == [(40, "GiB"), (41, "GiB"), (1.35, "s"), (40.2, "GiB")]
    assert in_order(answer, [1, 40, 2, 41])  # best k and its peak, its neighbour and its peak
    assert "nested" in answer.split(";")[-1] and amounts(answer.split(";")[-1]) == [(40.2, "GiB")]
    oom = _sweep()
    oom.loc[3, "peak_gib"] = 30.0
    with_oom = mb.checkpoint_sentence(oom, parameter_bytes=GiB)
    assert numbers(with_oom)[:3] == [4, 30, 1.3] and "out of memory" in clause_of(with_oom, "k = 8")
    assert not amounts(clause_of(with_oom, "k = 8"))
    fig = mb.checkpoint_figure(_sweep().assign(modelled_peak_gib=50.0), "toy")
    assert [line.get_label() for line in fig.axes[0].lines[:2]] == ["measured peak", "model: 4×params + (N/k)·r + k·A"]
    assert list(fig.axes[0].lines[0].get_xdata()) == [1, 2, 4]


def test_checkpoint_model_sentence():
    model = pd.DataFrame(dict(strategy=["none", "single", "single", "nested"], group_size=[math.nan, 1, 2, math.nan],
                              modelled_bytes=[40 * MiB, 14 * MiB, 24 * MiB, 12 * MiB],
                              extra_forwards=[0, 1, 1, 1.5], boundary_bytes=MiB, block_bytes=10 * MiB, k_star=0.63))
    text = mb.checkpoint_model_sentence(model, num_blocks=4, context=64)
    single, nested = sentences(text)
    assert amounts(single) == [(1, "MiB"), (10, "MiB"), (14, "MiB"), (40, "MiB")]  # r, A; k = 1's and none's
    assert "k* = √(N·r/A)" in single and in_order(single, [64, 0.63, 4, 1, 14])  # context, k*, N, the predicted k
    assert "Nested" in nested and amounts(nested) == [(12, "MiB")] and numbers(nested) == [12, 1.5, 1]


def test_shown_drops_provenance_columns():
    df = pd.DataFrame(dict(a=[1, 2], gpu="cpu", torch="2", commit="x", source="03", status="ok", error=""))
    from lab.book.report import shown

    assert shown(df).columns.tolist() == ["a"]
    assert "status" in shown(df.assign(status=["ok", "oom"])).columns
    assert len(shown(df, head=1)) == 1


def test_the_saving_grows_only_when_it_grows_at_every_context():
    """-0.2%, 0%, +1.1%, -15.5% (03's H200 training step) is not a saving that grows with the context."""
    rows = [("train_step", c, d, v, "ok") for c, f, b in ((128, 100.0, 99.8), (256, 100.0, 100.0),
                                                           (512, 100.0, 101.1), (2048, 100.0, 84.5))
            for d, v in (("fp32", f), ("bf16", b))]
    uneven = mb.mixed_precision_sentence(pd.DataFrame(rows, columns=["mode", "context", "dtype", "peak_gib", "status"]))
    assert "does not grow steadily" in uneven
    steady = mb.mixed_precision_sentence(_peaks()[lambda t: t["mode"] == "forward"])
    assert "grows with the context" in steady
    assert not mb.mixed_precision_answer(_peaks()).startswith("only")
