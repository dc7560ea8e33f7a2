#!/bin/bash
# (As run this session: a frozen worktree of b613ca7 at /work/acc51-code; the next session reruns it to add seeds 52-53
# and the sync repro. The driver skips finished units.)
# Issue 51: accuracy check of generating ahead: cppo-pooled with max_staleness=1 at seeds 51-53 (sweep 41's
# cppo-pooled units of those seeds are the sync arm), then the sync arm of seed 51 rerun at this code (it must equal
# sweep 41's unit: the sync path unchanged). One unit at a time: a unit generating ahead uses both cores.
cd /work/acc51-code
export PYTHONPATH=/work/acc51-code OMP_NUM_THREADS=1
PY=/work/main/.venv/bin/python
$PY benchmarks/accuracy_seeds.py --seeds 51 52 53 --arms cppo-pooled-overlap --jobs 1 --out /work/acc51-out/sweep
mkdir -p /work/acc51-out/repro/units/before && cp -n /work/acc51-out/sweep/units/before/result.json /work/acc51-out/repro/units/before/
$PY benchmarks/accuracy_seeds.py --seeds 51 --arms cppo-pooled --jobs 1 --out /work/acc51-out/repro
