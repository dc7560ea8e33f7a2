#!/usr/bin/env python
"""One unit of an accuracy sweep: one arm on one seed (``benchmarks/accuracy_seeds.py --arms`` starts this script once
per unit); the code and its usage in full: ``benchmarks/sweeps/arm.py``."""

from sweeps.arm import cli

if __name__ == "__main__":
    cli()
