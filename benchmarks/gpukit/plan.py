"""What the kit runs: its parts, their time budgets, exit statuses, and the two plans (a GPU's, the dry run's)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
TESTS = REPO / "tests"
ENTRY = BENCH / "gpu_check.py"
DEFAULT_OUT = BENCH / "results" / "gpu"
DEFAULT_WHEELS = REPO / ".gpu-wheels"
PARTS = ("tests", "loss", "select", "e2e")

#: Seconds each part may take on one H200, Triton compilation and process start-up included; its process group is
#: killed after that. Measured on the lent H200 (gVisor, 16 CPU cores) on 2026-12-04: the tests part ran 21 of its
#: 82 tests in 138 s on 4 workers (Triton compilation there is the cost), the loss part took 74 s for its two shapes
#: with Liger-Kernel carried, select 29 s, e2e more than 100 s (speedup.py unfinished). The tests part gets the most;
#: a stopped part keeps what it finished, with each failure's message (tests/conftest.py's failure log). Since issue 48
#: the loss part has 20 s more (a third shape, Liger's; a third fused method; 5 rounds instead of 7), the tests part
#: 15 s less. They add up to 465 s, inside DEADLINE_S with the set-up (imports, wheels: about 15 s).
BUDGET_S = {"tests": 200.0, "loss": 130.0, "select": 35.0, "e2e": 100.0}
#: The default --deadline: the whole kit, set-up and summary included, inside the 8 minutes the kit was asked to fit
#: (all 82 CUDA tests need more than that on the lent H200: run ``--parts tests`` alone for them).
DEADLINE_S = 475.0
#: Seconds kept back for the summary; a part is skipped when less than MIN_PART_S would be left for it.
RESERVE_S = 5.0
MIN_PART_S = 10.0
#: Exit statuses.
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INCOMPLETE = 0, 1, 2, 3

TINY_QWEN2 = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 1,
}  # fmt: skip
#: The packed-forward measurement's model on a GPU: head dim 64 (within flash-attention's), 2 layers, grouped KV
#: heads (the pass/fail check of the property is tests/cppo/step/test_cuda_models.py, run by the tests part).
PACKED_QWEN2 = {
    "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the parts run: on the GPU (:data:`GPU_PLAN`) or the dry run's tiny CPU version of the same code paths."""

    dry: bool
    device: str
    loss_shapes: tuple[tuple[int, int, int, str], ...]  # (T, H, V, dtype)
    loss_repeats: int
    loss_warmup: int
    select_groups: tuple[int, ...]
    select_repeats: int
    select_warmup: int
    launch_calls: int  # profiled calls per op for the launch counts
    pytest_workers: int  # pytest-xdist workers (0: none)
    packed_dtypes: tuple[str, ...]
    packed_lengths: tuple[int, ...]
    packed_model: dict[str, int]
    speedup_argv: tuple[str, ...]  # speedup.py's arguments, less --out and --rollout-backend


GPU_PLAN = Plan(
    dry=False,
    device="cuda",
    # the kit's shape (Qwen2.5-1.5B's head, 16k tokens), Liger-Kernel PR #1356's published one, and fp32
    loss_shapes=(
        (16_384, 1536, 151_936, "bfloat16"),
        (8192, 4096, 128_256, "bfloat16"),
        (2048, 896, 151_936, "float32"),
    ),
    loss_repeats=4,
    loss_warmup=1,
    select_groups=(64, 1024, 4096),
    select_repeats=200,
    select_warmup=20,
    launch_calls=10,
    pytest_workers=4,
    packed_dtypes=("float32", "bfloat16"),
    packed_lengths=(1, 37, 64, 129, 200, 300),
    packed_model=PACKED_QWEN2,
    # the speedup-cpu preset (tiny Qwen2, G = 16, 48 new tokens): GRPO 4 steps of 1 question, CPPO P=0.75 1 of 4
    speedup_argv=("--device", "cuda", "--pruning-rates", "0", "0.75", "--questions", "4", "--no-progress"),
)
DRY_PLAN = Plan(
    dry=True,
    device="cpu",
    loss_shapes=((512, 32, 1000, "float32"), (512, 48, 700, "bfloat16")),
    loss_repeats=1,
    loss_warmup=0,
    select_groups=(4,),
    select_repeats=2,
    select_warmup=1,
    launch_calls=1,
    pytest_workers=0,
    packed_dtypes=("float32",),
    packed_lengths=(1, 9, 5),
    packed_model={**TINY_QWEN2, "vocab_size": 300},
    speedup_argv=(
        *("--device", "cpu", "--model-config", json.dumps(TINY_QWEN2)),
        *"--group-size 4 --pruning-rates 0 0.5 --questions 2 --set max_completion_length=4 --backend torch".split(),
        *("--no-warmup", "--no-progress", "--no-plot"),
    ),
)
