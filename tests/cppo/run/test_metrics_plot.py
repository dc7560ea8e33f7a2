"""metrics.png's reward panel: a reward equal to the accuracy is one line (not one hidden under the other), the
running mean appears only over 10 or more steps and says its window, and held-out accuracy is drawn where the run
evaluated."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from cppo.run.metrics import _reward_panel, plot  # noqa: E402


def _labels(records):
    fig, ax = plt.subplots()
    _reward_panel(ax, records, "t")
    labels = [line.get_label() for line in ax.get_lines()]
    plt.close(fig)
    return labels


def _records(n, *, same=True, eval_at=()):
    rows = []
    for i in range(n):
        acc = (i % 3) / 2
        r = {"step": i + 1, "reward_mean": acc if same else acc + 0.25, "accuracy": acc}
        if i + 1 in eval_at:
            r["eval/accuracy"] = 0.3
        rows.append(r)
    return rows


def test_reward_equal_to_accuracy_is_one_labelled_line_and_short_runs_have_no_running_mean():
    assert _labels(_records(8)) == ["reward mean = training-batch accuracy (no format reward)"]


def test_separate_lines_running_mean_and_held_out_accuracy(tmp_path):
    labels = _labels(_records(20, same=False, eval_at=(10, 20)))
    assert labels == [
        "reward mean (training batch)",
        "accuracy (training batch, sampled)",
        "reward, running mean over 4 steps",
        "held-out accuracy (greedy, test split)",
    ]
    plot(_records(20, same=False, eval_at=(10, 20)), str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").stat().st_size > 0
