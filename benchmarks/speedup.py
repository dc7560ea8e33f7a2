#!/usr/bin/env python
"""CPPO against GRPO, end to end, on the same questions: where the time goes and what pruning saves.

``python benchmarks/speedup.py [--config PRESET_OR_YAML] [--set key=value ...]`` (``--help``: every flag). The
benchmark lives in ``benchmarks/endtoend/``: ``speedup.py`` (the run, its usage in full), ``args.py`` (its flags),
``report.py`` (its rows, tables and plots)."""

from endtoend.speedup import cli

if __name__ == "__main__":
    cli()
