#!/usr/bin/env python
"""Generation ahead of training (``max_staleness=1``) against the synchronous run, whole run, on the same questions.

``python benchmarks/overlap.py [--config PRESET_OR_YAML] [--set key=value ...] --out DIR`` (``--help``: every flag).
The benchmark lives in ``benchmarks/endtoend/overlap.py`` (its usage in full)."""

from endtoend.overlap import cli

if __name__ == "__main__":
    cli()
