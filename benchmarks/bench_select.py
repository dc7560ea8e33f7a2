#!/usr/bin/env python
"""group_advantages, select_completions and cppo_select timed on each backend.

``python benchmarks/bench_select.py [--device cuda] [--out FILE]`` (``--help``: every flag). The code and its usage
in full: ``benchmarks/components/selection.py``; imported (the GPU kit's select part), this name is that module."""

import sys

from components import selection

if __name__ == "__main__":
    selection.main()
else:
    sys.modules[__name__] = selection
