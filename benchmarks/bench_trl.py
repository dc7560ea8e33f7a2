#!/usr/bin/env python
"""Stock ``trl.GRPOTrainer`` against ``cppo.trl.CPPOTrainer`` at several pruning rates, on the same work.

``python benchmarks/bench_trl.py [--model ...] [--out FILE]`` (``--help``: every flag; each run is this script again,
with ``--worker``). The code and its usage in full: ``benchmarks/components/trainer.py``; imported, this name is that
module."""

import sys

from components import trainer

if __name__ == "__main__":
    trainer.main()
else:
    sys.modules[__name__] = trainer
