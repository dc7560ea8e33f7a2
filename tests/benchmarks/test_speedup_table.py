"""Issue 39: the table ``benchmarks/speedup.py`` prints holds the essential columns in 120 characters (every field
stays in the JSON) and says under it what its less obvious columns mean."""

from __future__ import annotations

import dataclasses

from cppo import TrainConfig


def _rows(report):
    runs = []
    for p, train, steps in ((0.0, 16.0, 16), (0.9375, 0.8, 1)):  # the second: above its ideal 16x
        config = TrainConfig(group_size=16, pruning_rate=p, allocation=True, questions_per_step=1)
        config = dataclasses.replace(config, num_steps=steps, max_questions=16)
        phases = dict.fromkeys(report.PHASES, 0.0) | {"generation": 10.0, "policy_fwd_bwd": train}
        sums = {"phase_seconds": phases, "total_seconds": 10.0 + train, "tokens_trained": 100 * config.pruning.keep}
        sums |= {"tokens_forward": 0, "completions": 256, "completions_kept": 16 * config.pruning.keep, "questions": 16}
        runs.append(report.RateRun(config=config, sums=sums | {"reward_mean": 0.5, "accuracy": 0.25}))
    return report.build_rows(runs)


def test_the_table_fits_120_characters(report):
    rows = _rows(report)
    text = report.format_table(rows)
    assert max(len(line) for line in text.splitlines()) <= 120
    head, _, grpo, cppo = text.split("\n\n")[0].splitlines()
    cells = dict(zip(head.split("|"), cppo.split("|")))
    assert cells[" speedup train "].strip() == "20.00x" and cells[" ideal "].strip() == "16.00x"
    assert cells[" keep "].strip() == "1/16" and cells[" accuracy "].strip() == "25.0%"
    assert cells[" gen share "].strip() == f"{100 * 10.0 / 10.8:.0f}%"
    assert len(head.split("|")) - 2 == len(report.TABLE_HEAD) < 21  # was 21 columns, wrapped


def test_the_notes_explain_amdahl_gen_share_and_a_speedup_above_the_ideal(report):
    notes = report.format_table(_rows(report)).split("\n\n", 1)[1]
    for column in report.TABLE_HEAD[1:]:
        assert column in notes, column
    assert "- Amdahl (train only): the whole-run speedup had only the training phases shrunk" in notes
    assert "- gen share: generation's share of the row's total seconds" in notes
    assert "a measured one above it:" in " ".join(notes.split())
