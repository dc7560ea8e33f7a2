"""The end-to-end benchmark behind ``benchmarks/speedup.py``: CPPO against GRPO on the same questions (``speedup``: the
run; ``args``: its flags and trainer config; ``report``: its rows, tables and plots)."""
