"""Metrics as JSON lines and a PNG of the reward and per-phase time curves."""

from __future__ import annotations

import json
import os

PHASES = ("generate", "reward", "select", "logprobs", "update", "optimizer")


def append_jsonl(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def write_jsonl(path: str, records: list[dict]) -> None:
    """Replaces ``path`` with ``records`` (atomically)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(records: list[dict], path: str, *, title: str = "CPPO") -> str:
    """Two panels: reward mean and accuracy per step; seconds per phase per step (stacked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    reward = [r["reward_mean"] for r in records]
    ax1.plot(steps, reward, label="reward mean", marker=".", alpha=0.5)
    ax1.plot(steps, [r["accuracy"] for r in records], label="accuracy", marker=".", alpha=0.5)
    window = max(1, min(10, len(reward) // 5))
    smooth = [
        sum(reward[max(0, i - window + 1) : i + 1]) / len(reward[max(0, i - window + 1) : i + 1])
        for i in range(len(reward))
    ]
    ax1.plot(steps, smooth, label=f"reward, mean of last {window}", color="black")
    ax1.set_xlabel("step")
    ax1.set_title(f"{title}: reward")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.stackplot(steps, *[[r.get(f"time/{p}", 0.0) for r in records] for p in PHASES], labels=PHASES)
    ax2.set_xlabel("step")
    ax2.set_ylabel("seconds")
    ax2.set_title("time per phase")
    ax2.legend(loc="upper left", fontsize="small")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
