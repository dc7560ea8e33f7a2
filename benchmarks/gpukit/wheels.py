"""The offline wheel installer (the pure-Python wheels carried in ``--wheels``, e.g. Liger-Kernel, installed with
``pip --no-index --no-deps`` into a temporary folder put on the path) and the check that every module the parts
import imports."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import subprocess
import sys
from typing import Any

#: Modules the parts import (``import`` checked by the parent first) and optional ones (looked up only).
REQUIRED = (
    "torch", "triton", "transformers", "pytest", "hypothesis", "matplotlib", "yaml", "tqdm", "cppo_kernels", "cppo",
    "cppo.step", "bench_loss", "bench_select", "speedup",
)  # fmt: skip
OPTIONAL = ("xdist", "liger_kernel", "flash_attn", "vllm", "math_verify", "gguf")


def install_wheels(folder: pathlib.Path, target: pathlib.Path) -> dict:
    """Installs every ``*.whl`` of ``folder`` into ``target`` (pip, no index, no dependencies) and imports each
    top-level module they brought. Nothing in the folder (or no folder) is fine: the optional parts are skipped."""
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    info: dict[str, Any] = {"folder": str(folder), "wheels": [w.name for w in wheels], "installed": [], "imports": {}}
    if not wheels:
        return info
    cmd = [
        sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
        "--disable-pip-version-check", "--target", str(target), *map(str, wheels),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        info["error"] = (proc.stdout + proc.stderr)[-2000:]
        return info
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    entries = sorted(p.name for p in target.iterdir())
    info["installed"] = [name.removesuffix(".dist-info") for name in entries if name.endswith(".dist-info")]
    modules = [
        p.name.removesuffix(".py") for p in map(target.joinpath, entries)
        if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.name != "__init__.py")
    ]  # fmt: skip
    info["imports"] = {name: try_import(name) for name in modules}
    return info


def try_import(name: str) -> str:
    """``ok``, or the error (type and message) importing ``name`` raised."""
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - reported, never fatal
        return f"{type(e).__name__}: {e}"[:300]
    return "ok"


def check_imports() -> dict:
    """``ok`` or the error of every module the parts import; optional modules: whether they are installed."""
    required = {name: try_import(name) for name in REQUIRED}
    optional = {name: importlib.util.find_spec(name) is not None for name in OPTIONAL}
    return {"required": required, "optional": optional}
