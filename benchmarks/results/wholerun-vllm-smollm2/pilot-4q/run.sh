cd /work/main
# The pilot of issue 51 (2026-12-07 22:09-22:21 UTC), run in benchmarks/runs/pilot51c-vllm and copied here: GRPO and
# CPPO at P = 0.75 on 4 questions, 1 round, vLLM. Two earlier pilots with three arms were killed by the machine's OOM
# killer (other sessions held 14-17 GB of the 23.5 GB).
export OMP_NUM_THREADS=1
exec .venv/bin/python benchmarks/speedup.py --config smollm2-accuracy-cpu --dataset gsm8k --dataset-path ../shared/data/gsm8k \
  --max-prompt-length 512 --group-size 16 --max-new-tokens 128 --rollout-backend vllm --threads 1 \
  --pruning-rates 0 0.75 --questions 4 --rounds 1 --out benchmarks/runs/pilot51c-vllm --name wholerun
