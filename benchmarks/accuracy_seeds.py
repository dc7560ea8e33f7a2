"""Accuracy over seeds: CPPO, its variants and GRPO, each seed with its own training questions, evaluated on the same
held-out problems.

``python benchmarks/accuracy_seeds.py --seeds ... [--arms ARM ...] --out DIR [-- SETTINGS]`` (``--help``: every flag).
The sweep lives in ``benchmarks/sweeps/``: ``seeds.py`` (the runner, its usage in full), ``arm.py`` (one (seed, arm)
unit, run as ``benchmarks/accuracy_arm.py``), ``units.py`` (the units' folders), ``files.py`` (the result files it
combines and what they must agree on), ``report.py`` and ``stop.py`` (the summary), ``stats.py`` (the statistics)."""

from sweeps.seeds import cli

if __name__ == "__main__":
    cli()
