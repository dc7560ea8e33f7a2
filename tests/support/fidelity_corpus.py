"""Completions to compare cppo's scoring with the official one (tests/support/official_cppo.py): hand-made edge cases,
completions built from real GSM8K / MATH-500 solutions in many layouts, and random text over the tags' alphabet.

``scale`` sizes the corpus: CI uses a small one; ``.venv/bin/python tests/support/fidelity_corpus.py`` runs the
comparison on a large one and prints the counts.
"""

from __future__ import annotations

import json
import os
import pathlib
import random

#: ``../shared/data`` beside the project (``$CPPO_SHARED`` overrides ``../shared``, e.g. from a git worktree).
SHARED = pathlib.Path(os.environ.get("CPPO_SHARED", pathlib.Path(__file__).resolve().parents[2].parent / "shared"))
SHARED = SHARED / "data"

#: Layouts of a completion around a reasoning text {r} and an answer {a} (GSM8K and the issue's edge-case classes).
LAYOUTS = (
    "<think>{r}</think>\n<answer>{a}</answer>",
    "<think>\n{r}\n</think>\n<answer>\n{a}\n</answer>",
    "<think>{r}</think><answer>{a}</answer>",  # no newline: the old prompt's layout
    "<think>{r}</think>\n\n<answer>{a}</answer>",  # blank line
    "<think>{r}</think> \n<answer>{a}</answer>",  # space
    " <think>{r}</think>\n<answer>{a}</answer>",  # leading space
    "<think>{r}</think>\n<answer>{a}</answer>\n",
    "<think>{r}</think>\n<answer>{a}</answer>\nSo the answer is {a}.",  # text after </answer> on the next line
    "<think>{r}</think>\n<answer>{a}</answer> trailing",
    "<think>{r}</think>\r\n<answer>{a}</answer>",
    "<think>{r} <answer>7</answer></think>\n<answer>{a}</answer>",  # stray <answer> inside the thinking
    "<think>{r}</think>\n<answer>{a}</answer><answer>{a}",  # unclosed last <answer>
    "<think>{r}</think>\n<answer>{a}",  # unclosed
    "{r}\n#### {a}",  # untagged: the GSM8K solution layout
    "{r} The answer is {a}",
    "{r}",
    "<think>{r}</think>\n<answer>{a}</answer>\n<think>again</think>\n<answer>{a}</answer>",
    "<answer>{a}</answer>",
    "<think>{r}</think>\n<answer></answer>",
    "<think>{r}</think>\n<answer>...</answer>",
)


def answer_variants(gold: str) -> list[str]:
    """Ways a model writes (or misses) the gold number: the float-tolerance, leading-dot, comma and sign classes."""
    try:
        value = float(gold)
    except ValueError:
        return [gold, gold + "0", "x"]
    whole = int(value) if value == int(value) else value
    out = [gold, f"{value}", f"{whole:,}", f"{whole:,}".replace(",", ", "), f"{whole:,}".replace(",", " ,"),
           f"${gold}", f"{gold}%", f"{gold} dollars", f"{value}0000001", f"{value + 1e-7}", f"-{gold}", f"{gold}.0",
           f".{gold}", f"0{gold}", f"{gold} or {gold}", f"{gold}, {gold}", f"{int(value) + 1}", f"{gold}.", ".5",
           f"{gold}/1", f"\\boxed{{{gold}}}", "...", f" {gold} ", f"{gold}\n", f"1,{gold}", f"{gold},000"]  # fmt: skip
    return out


def gsm8k_rows(split: str) -> list[dict]:
    path = SHARED / "gsm8k" / f"{split}.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []


def gsm8k_corpus(rows: list[dict], *, per_row: int, seed: int = 0) -> list[tuple[str, str]]:
    """``(completion, raw GSM8K answer)`` pairs: ``per_row`` layouts x answer variants of each real solution (its
    reasoning as the thinking), chosen at random but seeded."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        raw = row["answer"]
        reasoning, _, gold = raw.partition("####")
        gold = gold.strip().replace(",", "")
        variants = answer_variants(gold)
        for _ in range(per_row):
            layout = rng.choice(LAYOUTS)
            out.append((layout.format(r=reasoning.strip(), a=rng.choice(variants)), raw))
    return out


def random_texts(n: int, *, seed: int = 0, max_parts: int = 24) -> list[str]:
    """Random concatenations of tag fragments, digits, signs, separators and odd characters."""
    parts = ["<think>", "</think>", "<answer>", "</answer>", "</think>\n<answer>", "\n", "\r\n", " ", "\t", ",",
             ".", "..", "...", "-", "$", "%", "0", "1", "18", "7.5", ".5", "-3", "1,234", "a", "####", "\u00a0",
             "\u0663", "\u2028", "\x00", "\\boxed{", "}", "<", ">", "/"]  # fmt: skip
    rng = random.Random(seed)
    return ["".join(rng.choice(parts) for _ in range(rng.randint(0, max_parts))) for _ in range(n)]


def math500_rows() -> list[dict]:
    path = SHARED / "math500" / "test.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []


def math_corpus(rows: list[dict], *, per_row: int, seed: int = 0) -> list[tuple[str, str]]:
    """``(completion, full solution)`` pairs: each MATH-500 answer boxed / unboxed / wrong, inside or outside the
    tags, or the reference solution itself."""
    rng = random.Random(seed)
    layouts = (
        "<think>{r}</think>\n<answer>Therefore, the final answer is: $\\boxed{{{a}}}$. I hope it is correct</answer>",
        "<think>{r}</think>\n<answer>{a}</answer>",  # unboxed inside the tags
        "The answer is $\\boxed{{{a}}}$.",  # boxed outside the tags
        "<think>{r}</think>\n<answer>\\boxed{{{a}}}</answer>",
        "<think>{r}</think>\n<answer>${a}$</answer>",
        "{r}",
    )
    out = []
    for row in rows:
        answers = [row["answer"], row["answer"] + "+1", "0", "\\frac{1}{2}"]
        for _ in range(per_row):
            text = rng.choice(layouts).format(r=row["solution"][:400], a=rng.choice(answers))
            out.append((text, row["solution"]))
    return out


def main() -> None:
    """The large local comparison (not CI): prints corpus sizes and disagreement counts."""
    import sys
    import time

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import official_cppo as off

    from cppo.tasks.data import normalise_row
    from cppo.tasks.rewards import gsm8k_eval_correct, gsm8k_score, has_official_format

    rows = gsm8k_rows("train") + gsm8k_rows("test")
    start = time.perf_counter()
    corpus = gsm8k_corpus(rows, per_row=8) + [(t, "x\n#### 18") for t in random_texts(30000)]
    corpus += [(t, r["answer"]) for t, r in zip(random_texts(10000, seed=1), rows)]
    bad = {"format": 0, "accuracy": 0, "eval": 0}
    for text, raw in corpus:
        gold = normalise_row({"question": "q", "answer": raw}, source="corpus")["answer"]
        bad["format"] += has_official_format(text) != bool(off.format_reward(text))
        bad["accuracy"] += gsm8k_score(text, gold) != off.gsm8k_accuracy_reward(text, raw)
        bad["eval"] += gsm8k_eval_correct(text, gold) != off.gsm8k_eval_is_correct(text, gold)
    print(f"GSM8K/format corpus: {len(corpus)} completions, disagreements {bad}, {time.perf_counter() - start:.1f} s")

    from cppo.tasks.math_grading import MathVerifier

    verifier = MathVerifier()
    pairs = math_corpus(math500_rows(), per_row=6)
    start = time.perf_counter()
    for mode, oracle in (("reward", off.math_accuracy_reward), ("eval", off.math_eval_is_correct)):
        ours = verifier.scores(mode, [t for t, _ in pairs], [s for _, s in pairs])
        want = [float(oracle(t, s)) for t, s in pairs]
        diff = [i for i, (a, b) in enumerate(zip(ours, want)) if a != b]
        print(f"MATH {mode}: {len(pairs)} completions, {len(diff)} disagreements, timeouts {verifier.timeouts}")
    print(f"{time.perf_counter() - start:.1f} s")
    verifier.close()


if __name__ == "__main__":
    main()
