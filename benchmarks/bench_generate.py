#!/usr/bin/env python
"""Generation: the ``vllm`` engine against the ``hf`` engine on the same policy, alternated, with the CPU seconds and
threads each call ran with.

``python benchmarks/bench_generate.py [--threads N ...] [--max-new-tokens N ...] [--out FILE]`` (``--help``: every
flag). The code and its usage in full: ``benchmarks/components/generation.py`` (``usage.py``: what a call is charged);
imported, this name is that module."""

import sys

from components import generation

if __name__ == "__main__":
    sys.exit(generation.main())
else:
    sys.modules[__name__] = generation
