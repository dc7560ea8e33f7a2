"""math-verify in a worker process: a hard deadline per completion, one math-verify call per completion (the metric
reuses the reward's verdict), recovery from a dead worker, and no exception on odd text."""

import os
import time

import pytest

import cppo.tasks._math_verify_worker as worker
from cppo.tasks import math_grading
from cppo.tasks.math_grading import MathVerifier
from cppo.tasks.rewards import accuracy_reward, eval_correct, training_correct

BOMBS = ["\\boxed{9^{9^{9^{9}}}}", "$\\boxed{9^{9^{9^{9}}}}$ and $\\boxed{9^{9^{9^{9}}}}$"]


@pytest.fixture(scope="module")
def fast():
    v = MathVerifier(timeout=0.25)
    yield v
    v.close()


def test_bombs_and_a_megabyte_get_a_verdict_within_the_deadline(fast):
    """The official code spends 5 s per math-verify call on these (twice: reward and metric); here each completion
    is cut off at the deadline and scores 0, as a math-verify time-out does in the official code."""
    texts = [*BOMBS, "\\frac{" * 200_000, "<answer>\\boxed{2}</answer>"]
    scores = fast.scores("reward", texts, ["$\\boxed{2}$"] * len(texts))
    assert scores == [0.0, 0.0, 0.0, 2.0]
    assert fast.timeouts >= 2  # the bombs overran; the last completion was graded by a fresh child
    assert fast.scores("eval", ["\\boxed{9^{9^{9^{9}}}}"], ["$2$"]) == [0.0]


def test_a_dead_worker_is_replaced(fast):
    fast.scores("reward", ["\\boxed{1}"], ["$1$"])
    fast._proc.kill()
    fast._proc.wait()
    assert fast.scores("reward", ["\\boxed{3}"], ["$3$"]) == [2.0]


class StubGrader:
    """Grades "sleep" by hanging, "exit" by killing its process, "raise" by raising, anything else as 1.0."""

    def grade(self, mode, completion, solution):
        if completion == "sleep":
            time.sleep(30)
        if completion == "exit":
            os._exit(3)
        if completion == "raise":
            raise RecursionError
        return 1.0


def test_children_survive_hangs_crashes_and_errors():
    items = [["reward", c, "g"] for c in ("ok", "sleep", "ok", "exit", "raise", "ok")]
    children = worker.Children(StubGrader())
    try:
        assert children.batch(items, 0.2) == [1.0, None, 1.0, None, None, 1.0]
        first = children.pid
        assert children.batch(items[:1], 0.2) == [1.0] and children.pid == first  # the child lives on
    finally:
        children.stop()


def test_the_accuracy_metric_reuses_the_rewards_verdicts(monkeypatch):
    v = math_grading.verifier()
    asked = []
    real = v._ask
    monkeypatch.setattr(v, "_ask", lambda items: asked.append(len(items)) or real(items))
    texts = [f"so \\boxed{{{i}}} for case {time.time()}" for i in (1, 0, 2, 8)]  # new texts: not cached yet
    row = dict(answer=["1", "0", "2", "7"], kind=["math", "math", "gsm8k", "math"], solution=["$1$", "$1$", None, None])
    assert accuracy_reward([""] * 4, texts, **row) == [2.0, 0.0, 0.0, 0.0]
    assert training_correct(texts, **row) == [True, False, False, False]
    assert asked == [3]  # the three MATH completions, graded once
    assert eval_correct(texts, **row) == [True, False, False, False]  # the evaluation's check is its own call
    assert asked == [3, 3]


def test_odd_text_never_raises():
    odd = ["", "\x00", "\ud800\udfff\ud800", "}" * 1000, "\\boxed{", "$$", "\\" * 10_000, "\U0001f600" * 100]
    n = len(odd)
    row = dict(answer=["1"] * n, kind=["math"] * n, solution=["$1$"] * n)
    assert set(accuracy_reward([""] * n, odd, **row)) <= {0.0, 2.0}
    row = dict(answer=["1"] * n, kind=["gsm8k"] * n, solution=[None] * n)
    assert set(accuracy_reward([""] * n, odd, **row)) <= {0.0, 1.5, 2.0}


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1", True])
def test_bad_timeouts_are_refused(bad):
    with pytest.raises(ValueError, match="reward_timeout"):
        MathVerifier(timeout=bad)


def test_grading_works_off_the_main_thread(fast):
    """math-verify's own timeouts (signal.alarm) refuse to run off the main thread; the worker does not care."""
    import threading

    out = []
    thread = threading.Thread(target=lambda: out.extend(fast.scores("reward", ["\\boxed{5}"], ["$5$"])))
    thread.start()
    thread.join()
    assert out == [2.0]


def _descendants(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


def test_a_killed_worker_takes_its_grading_child_with_it_and_the_caller_goes_on():
    """SIGKILL of the worker while its child grades a bomb: the child dies too (no orphan at 100% CPU holding the
    reply pipe), and scores() restarts the worker and answers well before the bomb would have ended."""
    import signal
    import threading

    v = MathVerifier(timeout=3.0)
    try:
        v.scores("reward", ["\\boxed{1}"], ["$1$"])  # warm
        worker_pid = v._proc.pid
        result = {}
        thread = threading.Thread(target=lambda: result.update(s=v.scores("reward", [BOMBS[0]], ["$2$"])))
        thread.start()
        deadline = time.monotonic() + 10
        children = []
        while not children and time.monotonic() < deadline:
            children = _descendants(worker_pid)
            time.sleep(0.05)
        assert children, "the worker forked no grading child"
        os.kill(worker_pid, signal.SIGKILL)
        thread.join(timeout=30)
        assert not thread.is_alive(), "scores() still blocked after the worker died"
        assert result["s"] == [0.0]  # the restarted worker ran the bomb to its 3 s deadline: scored 0
        time.sleep(0.2)
        for pid in children:
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    finally:
        v.close()


def test_a_failed_fork_is_one_line_naming_the_cause(tmp_path, monkeypatch):
    """The worker answers a refused fork with an error, which the caller raises as one line (an OSError the CLI
    prints), not "is math-verify installed?"."""
    fake = tmp_path / "worker.py"
    fake.write_text(
        "import json, os, sys\n"
        "out = os.fdopen(int(sys.argv[2]), 'w', buffering=1)\n"
        "out.write(json.dumps('ready') + '\\n')\n"
        "for line in os.fdopen(int(sys.argv[1])):\n"
        "    out.write(json.dumps({'error': 'cannot fork a grading process (Resource temporarily unavailable): "
        "a process limit is reached'}) + '\\n')\n"
    )
    monkeypatch.setattr(math_grading, "WORKER", str(fake))
    v = MathVerifier(timeout=0.5)
    try:
        with pytest.raises(math_grading.WorkerError, match=r"cannot fork a grading process \(Resource"):
            v.scores("reward", ["\\boxed{1}"], ["$1$"])
    finally:
        v.close()


def test_children_report_a_refused_fork(monkeypatch):
    children = worker.Children(StubGrader())

    def refuse():
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(worker.os, "fork", refuse)
    with pytest.raises(worker.ForkFailed, match="Resource temporarily unavailable"):
        children.batch([["reward", "ok", "g"]], 0.2)
    assert children.pid is None


@pytest.mark.parametrize("bad", [0, -1.0, 9.3e9, float("inf"), float("nan"), True, "1"])
def test_reward_timeout_is_bounded(bad):
    with pytest.raises(ValueError, match=r"reward_timeout must be a number of seconds in \(0, 3600\]"):
        math_grading.check_timeout(bad)
    assert math_grading.check_timeout(3600) == 3600.0
