#!/usr/bin/env python
"""The fused CPPO loss against the naive loss and Liger's: time and working memory, forward and backward.

``python benchmarks/bench_loss.py [--device cuda] [--loss-types] [--out FILE]`` (``--help``: every flag). The code and
its usage in full: ``benchmarks/components/loss.py``; imported (the GPU kit's loss part), this name is that module."""

import sys

from components import loss

if __name__ == "__main__":
    loss.main()
else:
    sys.modules[__name__] = loss
