"""Where a benchmark writes when no ``--out`` is given: a new folder of the run's own, ``benchmarks/runs/NAME-<UTC
time>[-N]/`` (ignored by git), so that running a benchmark never rewrites the committed reference results in
``benchmarks/results/``; those change only when ``--out`` names them."""

from __future__ import annotations

import datetime
import pathlib

#: The folder that holds every run's own folder (``.gitignore`` lists it).
RUNS = pathlib.Path(__file__).resolve().parents[1] / "runs"  # benchmarks/runs/


def run_folder_name(benchmark: str, *, root: pathlib.Path = RUNS, now: datetime.datetime | None = None) -> pathlib.Path:
    """``root/BENCHMARK-YYYYmmddTHHMMSSZ``: the folder a run of ``benchmark`` starting ``now`` (default: now) gets
    unless another run took it first (see :func:`new_run_folder`). Creates nothing."""
    when = (now or datetime.datetime.now(datetime.timezone.utc)).astimezone(datetime.timezone.utc)
    return root / f"{benchmark}-{when:%Y%m%dT%H%M%SZ}"


def new_run_folder(benchmark: str, *, root: pathlib.Path = RUNS, now: datetime.datetime | None = None) -> pathlib.Path:
    """Creates and returns this run's own folder: :func:`run_folder_name`, or the first free one of its ``-2``,
    ``-3``, ... variants. Each is made with ``mkdir`` without ``exist_ok`` (atomic, exclusive), so two runs never
    share one. ValueError naming ``--out`` when ``root`` cannot be written."""
    base = run_folder_name(benchmark, root=root, now=now)
    folder, n = base, 1
    try:
        root.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                folder.mkdir()
                return folder
            except FileExistsError:
                n += 1
                folder = base.with_name(f"{base.name}-{n}")
    except OSError as e:
        raise ValueError(
            f"cannot create this run's folder under {str(root)!r} ({e.strerror or e}): name one with --out"
        ) from None


def out_file(out: pathlib.Path | None, *, benchmark: str, filename: str, prog: str) -> pathlib.Path:
    """The file a benchmark writes: ``out`` (the user's ``--out``, replaced atomically when it exists), else
    ``filename`` in a :func:`new_run_folder` of ``benchmark``. SystemExit with ``prog: error: ...`` (one line) when
    that folder cannot be made."""
    if out is not None:
        return out
    try:
        return new_run_folder(benchmark) / filename
    except ValueError as e:
        raise SystemExit(f"{prog}: error: {e}") from None
