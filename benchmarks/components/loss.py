"""Benchmark of the fused CPPO loss: time and working memory, forward and backward.

Compared (same inputs, CPPO recipe: token-mean, eps 0.2, beta 0.04 k3 with given reference and old log-probs):

- ``fused-grad-in-forward-torch`` (CPU) / ``fused-grad-in-forward-cublas`` (CUDA): :func:`cppo_kernels.fused_cppo_loss`
  with ``mode="grad-in-forward"``: chunk by chunk the logits (1 matmul), then, the chunk still in memory, dhidden and
  dweight (2 matmuls): its forward holds nearly all the work and allocates the gradients, its backward only hands
  them over;
- ``fused-two-pass-torch`` / ``fused-two-pass-triton`` (CUDA): ``mode="two-pass"``: the forward computes the
  log-probs (1 matmul), the backward recomputes the logits (3 matmuls);
- ``naive``: full fp32 ``[T, V]`` logits, then :func:`cppo_kernels.cppo_loss_from_logits`;
- ``liger-chunked``: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (loss_type dapo), gradients in its forward;
- ``liger-triton`` (CUDA only): the logits matmul + Liger's ``triton_grpo_loss`` on those logits;
- ``...-sapo``: each fused method again with TRL's ``sapo`` loss type (:data:`KIT_LOSS_TYPE`), beside dapo;
- with ``--loss-types``, instead: each of :data:`TIMED_LOSS_TYPES` on both fused paths (VESPO's per-sequence weight
  needs the whole sequence: on the gradient-in-forward path only where a sequence fits its chunk, ``--seq-len`` at
  most 192 on the CPU), and each one's time and working memory over dapo's on the same path (``vs_dapo``);
- ``matmul``: the plain ``[T, H] x [H, V]`` product, timed in the same run; every loss's forward+backward
  time is also reported as a multiple of it ("matmul-equivalents"), in wall time and in process CPU time
  (``time.process_time``, all threads; far less sensitive than wall time to other processes sharing the cores; on
  CUDA it means nothing and only the wall ratio counts).

Memory is measured above what is held just before the forward (gradients set to None first), as two peaks: the
forward's, and the backward's (the peak is reset between them). The *working memory* of each is that peak less the
returned gradients (dhidden + dweight) it already holds: all of them in the backward; in the forward only for the
methods that allocate them there (gradient-in-forward and Liger's chunked loss), so a workspace hidden under the
gradients still shows. On CUDA the peaks come from ``torch.cuda.max_memory_allocated``. On CPU they are the
kernel's resident-set high-water mark: writing ``5`` to ``/proc/self/clear_refs`` resets ``VmHWM`` in
``/proc/self/status``. Tensors of 1 MiB or more are mmap-ed by the allocator and unmapped when freed, so RSS follows
them; the script checks this at start-up by measuring one filled ``[T, V]`` fp32 tensor (``calibration``).

    python benchmarks/bench_loss.py                      # CPU: T=2048, H=896, V=151,936, fp32
    python benchmarks/bench_loss.py --device cuda        # also T=16,384, H=1,536 in bf16
    python benchmarks/bench_loss.py --loss-types         # TRL's loss types on the fused paths, against dapo

The JSON goes to ``--out`` and the PNG next to it, by default ``loss.json`` and ``loss.png`` in a new folder of the
run's own, ``benchmarks/runs/loss-<UTC time>/`` (ignored by git); the committed reference,
``benchmarks/results/loss.json``, changes only with ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import platform
import statistics
import time
import types
from collections.abc import Callable
from typing import NamedTuple

import torch
from benchkit.args import check_output_file, count
from benchkit.out import out_file

from components.memory import CpuMemory, CudaMemory, calibrate, sync
from cppo.fileio import atomic_path, run_metadata, write_json
from cppo_kernels import config as kernel_config
from cppo_kernels import cppo_loss_from_logits, fused_cppo_loss, fused_logprobs, use_backend
from cppo_kernels.loss import whole_sequence_tokens

OPTIONS = dict(epsilon_low=0.2, beta=0.04, kl_estimator="k3", loss_agg="token-mean")
#: TRL 1.16's loss types timed on the fused loss (grpo, bnpo and dr_grpo are dapo's surrogate with other aggregations),
#: each one's surrogate and aggregation read from the one table of loss types, :data:`cppo_kernels.config.LOSS_TYPES`
#: (:func:`loss_options`).
TIMED_LOSS_TYPES = ("dapo", "cispo", "sapo", "luspo", "vespo")
#: The options a loss type's recipe sets beyond its surrogate and aggregation: CISPO's cap of the ratio (its
#: ``epsilon_high``, TRL's recipe value).
RECIPE_OPTIONS = {"cispo": {"epsilon_high": 5.0}}
#: The new loss type :func:`build_methods` times beside dapo on each fused path (the GPU kit's ``loss`` part too).
KIT_LOSS_TYPE = "sapo"
#: The fused paths timed on each device, by name: ``(backend, mode, allocates the gradients in its forward)``; on CUDA
#: the GEMM path (what mode="auto" runs), the torch backend's cuBLAS path and the Triton kernels.
FUSED_PATHS = {
    "cuda": {
        "fused-grad-in-forward-gemm": ("triton", "grad-in-forward", True),
        "fused-grad-in-forward-cublas": ("torch", "grad-in-forward", True),
        "fused-two-pass-triton": ("triton", "two-pass", False),
    },
    "cpu": {
        "fused-grad-in-forward-torch": ("torch", "grad-in-forward", True),
        "fused-two-pass-torch": ("torch", "two-pass", False),
    },
}


def loss_options(loss_type: str) -> dict:
    """The options :data:`OPTIONS` takes for ``loss_type``: its ``surrogate`` and ``loss_agg`` from
    :data:`cppo_kernels.config.LOSS_TYPES`, and its :data:`RECIPE_OPTIONS`."""
    surrogate, loss_agg = kernel_config.LOSS_TYPES[loss_type]
    return {"surrogate": surrogate, "loss_agg": loss_agg, **RECIPE_OPTIONS.get(loss_type, {})}


#: :func:`loss_options` of every timed loss type, read-only: what the GPU kit's loss part reads under this name (its
#: fp64 oracle's options), computed from :data:`cppo_kernels.config.LOSS_TYPES`, not a table of this module's own.
LOSS_TYPES = types.MappingProxyType({loss_type: loss_options(loss_type) for loss_type in TIMED_LOSS_TYPES})


def method_name(path: str, loss_type: str) -> str:
    """The name of a fused method: its path, with ``-<type>`` for a loss type other than dapo."""
    return path if loss_type == "dapo" else f"{path}-{loss_type}"


#: Every fused method's name (:func:`method_name` over :data:`FUSED_PATHS` and :data:`TIMED_LOSS_TYPES`) -> its loss
#: type: how a result's method name is read back without taking it apart.
METHOD_LOSS_TYPES = {
    method_name(path, loss_type): loss_type
    for paths in FUSED_PATHS.values()
    for path in paths
    for loss_type in TIMED_LOSS_TYPES
}


def loss_type_of(name: str) -> str:
    """The loss type of a method in a result, for the GPU kit's loss part (this module never asks: its methods carry
    theirs, ``Method.loss_type``, and each row of :func:`run_config` records it as ``loss_type``):
    :data:`METHOD_LOSS_TYPES` for the names this module makes; a fused method named alike elsewhere (the kit's tests
    name ``fused-triton-sapo``) by its ``-<type>`` suffix; dapo for the others (the naive loss, Liger's)."""
    if name in METHOD_LOSS_TYPES:
        return METHOD_LOSS_TYPES[name]
    suffix = name.rsplit("-", 1)[-1]
    return suffix if name.startswith("fused-") and suffix in TIMED_LOSS_TYPES else "dapo"


SEQ_LEN = 512  # padded layout for Liger: T tokens as T / SEQ_LEN sequences (``--seq-len``)


def set_seq_len(n: int) -> None:
    """Every sequence of the run ``n`` tokens (``--seq-len``)."""
    global SEQ_LEN
    SEQ_LEN = n


# --------------------------------------------------------------------------------------------
# Methods: each a closure that runs the forward and returns the scalar loss
# --------------------------------------------------------------------------------------------


def naive_loss(hidden, weight, targets, advantages, cu_seqlens, old, ref):
    """Materialise fp32 logits, then :func:`cppo_kernels.cppo_loss_from_logits` (logsumexp, gather, policy loss)."""
    logits = (hidden @ weight.t()).float()  # [T, V]
    loss, _ = cppo_loss_from_logits(
        logits, targets, advantages, cu_seqlens=cu_seqlens, old_logprobs=old, ref_logprobs=ref, **OPTIONS
    )
    return loss


class Method(NamedTuple):
    run: Callable[[], torch.Tensor]  # the forward: returns the scalar loss
    grads_in_forward: bool  # allocates the returned gradients in its forward
    path: str | None = None  # a fused method's path (its dapo method's name); None for the others
    loss_type: str = "dapo"


def fused_methods(device: torch.device, inputs: dict, loss_types: tuple[str, ...]) -> dict[str, Method]:
    """``fused_cppo_loss`` on each path (gradient-in-forward: on CUDA the GEMM path of the Triton backend and the
    torch backend's cuBLAS code; two-pass), once per loss type, named by :func:`method_name` (VESPO
    gradient-in-forward only where the library runs its sequences whole)."""
    h, w, t, adv, cu, old, ref = (inputs[k] for k in ("hidden", "weight", "targets", "adv", "cu", "old", "ref"))

    def fused(backend: str, mode: str, loss_type: str) -> Callable[[], torch.Tensor]:
        options = {**OPTIONS, **loss_options(loss_type)}

        def run():
            with use_backend(backend):
                return fused_cppo_loss(h, w, t, adv, cu_seqlens=cu, old_logprobs=old, ref_logprobs=ref, mode=mode,
                                       **options)[0]  # fmt: skip

        return run

    paths = FUSED_PATHS["cuda" if device.type == "cuda" else "cpu"]
    # VESPO's weight needs its whole sequence: gradient-in-forward runs it in chunks of whole sequences, on the CPU
    # when a sequence fits one chunk (--seq-len at most the chunk: 192 on the CPU), else only two-pass
    whole = SEQ_LEN <= whole_sequence_tokens(device)
    methods = {}
    for path, (backend, mode, in_forward) in paths.items():
        for loss_type in loss_types:
            if loss_type == "vespo" and mode == "grad-in-forward" and not whole:
                continue
            methods[method_name(path, loss_type)] = Method(fused(backend, mode, loss_type), in_forward, path, loss_type)
    return methods


def build_methods(device: torch.device, inputs: dict) -> dict[str, Method]:
    h, w, t, adv, cu, old, ref = (inputs[k] for k in ("hidden", "weight", "targets", "adv", "cu", "old", "ref"))
    methods = {
        **fused_methods(device, inputs, ("dapo", KIT_LOSS_TYPE)),
        "naive": Method(lambda: naive_loss(h, w, t, adv, cu, old, ref), False),
    }
    try:
        methods.update(liger_methods(device, inputs))
    except ImportError as err:
        print(f"liger-kernel unavailable ({err}); skipping the Liger methods")
    return methods


def liger_methods(device: torch.device, inputs: dict) -> dict[str, Method]:
    """Liger-Kernel's GRPO losses on the padded layout (``T / SEQ_LEN`` rows of ``SEQ_LEN`` tokens)."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    h, w, t, adv, old, ref = (inputs[k] for k in ("hidden", "weight", "targets", "adv", "old", "ref"))
    H, B = h.shape[1], h.shape[0] // SEQ_LEN
    padded = dict(ref_per_token_logps=ref.view(B, SEQ_LEN), old_per_token_logps=old.view(B, SEQ_LEN))
    mask = torch.ones(B, SEQ_LEN, dtype=torch.int64, device=device)
    eps = dict(epsilon_low=0.2, epsilon_high=0.2)
    liger = LigerFusedLinearGRPOLoss(beta=OPTIONS["beta"], compiled=device.type == "cuda", use_ref_model=True,
                                     loss_type="dapo", **eps)  # fmt: skip
    methods = {"liger-chunked": Method(lambda: liger(h.view(B, SEQ_LEN, H), w, t.view(B, SEQ_LEN), mask, adv,
                                                     **padded)[0], True)}  # fmt: skip
    if device.type == "cuda":
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        pad = torch.zeros(B, 1, H, dtype=h.dtype, device=device)

        def liger_triton():  # triton_grpo_loss wants [B, L+1, V] logits (the last position is dropped)
            logits = torch.cat([h.view(B, SEQ_LEN, H), pad], dim=1) @ w.t()  # [B, L+1, V]
            return triton_grpo_loss(logits, padded["old_per_token_logps"], padded["ref_per_token_logps"],
                                    t.view(B, SEQ_LEN), adv, mask, temperature=1.0, beta=OPTIONS["beta"], eps_low=0.2,
                                    eps_high=0.2, loss_type="dapo", reduce=True)[0]  # fmt: skip

        methods["liger-triton"] = Method(liger_triton, False)
    return methods


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


def make_inputs(T: int, H: int, V: int, dtype: torch.dtype, device: torch.device) -> dict:
    if T % SEQ_LEN:
        raise SystemExit(f"--tokens must be a multiple of {SEQ_LEN} (the benchmark's sequence length)")
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(T, H, generator=g).to(device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * (2.0 / H**0.5)).to(device=device, dtype=dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g).to(device)
    S = T // SEQ_LEN
    cu = torch.arange(0, T + 1, SEQ_LEN, device=device)
    adv = torch.randn(S, generator=g).to(device)
    logp = fused_logprobs(hidden.detach(), weight.detach(), targets)  # [T]
    old = logp + 0.1 * torch.randn(T, generator=g).to(device)
    ref = logp + 0.1 * torch.randn(T, generator=g).to(device)
    return dict(hidden=hidden, weight=weight, targets=targets, adv=adv, cu=cu, old=old, ref=ref)


def measure(name: str, method: Method | Callable, inputs: dict, probe, device: torch.device) -> dict:
    """One forward+backward: wall and process CPU seconds of each half, the peak memory of each above the start."""
    params = [inputs["hidden"], inputs["weight"]]
    for p in params:
        p.grad = None
    gc.collect()
    sync(device)
    base = probe.start()
    c0, t0 = time.process_time(), time.perf_counter()
    if name == "matmul":
        with torch.no_grad():
            out = method()
            sync(device)
        c1, t1 = time.process_time(), time.perf_counter()
        del out
        return {"fwd": t1 - t0, "fwd_cpu": c1 - c0}
    loss = method.run()
    sync(device)
    c1, t1 = time.process_time(), time.perf_counter()
    fwd_peak = probe.peak() - base
    probe.start()  # the backward's own peak from here
    loss.backward()
    sync(device)
    c2, t2 = time.process_time(), time.perf_counter()
    bwd_peak = probe.peak() - base
    if not torch.isfinite(loss.detach()):
        raise RuntimeError(f"{name}: non-finite loss")
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    return {
        "fwd": t1 - t0,
        "bwd": t2 - t1,
        "fwd_cpu": c1 - c0,
        "bwd_cpu": c2 - c1,
        "fwd_peak": fwd_peak,
        "bwd_peak": bwd_peak,
        "fwd_work": fwd_peak - (grad_bytes if method.grads_in_forward else 0),
        "bwd_work": bwd_peak - grad_bytes,
        "grad_bytes": grad_bytes,
        "loss": loss.item(),
    }


def summarise(samples: list[dict], matmul_s: float, matmul_cpu_s: float) -> dict:
    """Medians of the times, worst of the memories, over the repeats of one method."""
    total = statistics.median(s["fwd"] + s["bwd"] for s in samples)
    total_cpu = statistics.median(s["fwd_cpu"] + s["bwd_cpu"] for s in samples)
    row = {
        "fwd_s": statistics.median(s["fwd"] for s in samples),
        "bwd_s": statistics.median(s["bwd"] for s in samples),
        "fwd_bwd_s": total,
        "fwd_bwd_matmuls": total / matmul_s,
        "fwd_bwd_cpu_s": total_cpu,
        "fwd_bwd_matmuls_cpu": total_cpu / matmul_cpu_s,
        **{f"{k}_bytes": max(s[k] for s in samples) for k in ("fwd_peak", "bwd_peak", "fwd_work", "bwd_work")},
        "grad_bytes": samples[0]["grad_bytes"],
        "loss": samples[0]["loss"],
    }
    row["peak_extra_bytes"] = max(row["fwd_peak_bytes"], row["bwd_peak_bytes"])
    row["workspace_bytes"] = max(row["fwd_work_bytes"], row["bwd_work_bytes"])  # the working memory
    return row


def run_config(
    T: int, H: int, V: int, dtype: torch.dtype, device: torch.device, repeats: int, warmup: int,
    loss_types: bool = False,
) -> dict:  # fmt: skip
    print(f"\n== T={T} H={H} V={V} {dtype} on {device} (threads={torch.get_num_threads()})")
    probe = CudaMemory() if device.type == "cuda" else CpuMemory()
    inputs = make_inputs(T, H, V, dtype, device)
    calibration = calibrate(probe, T, V, device)
    print(f"calibration: filled [T, V] fp32 {calibration['expected_bytes'] / 1e6:.0f} MB, probe saw "
          f"{calibration['measured_bytes'] / 1e6:.0f} MB")  # fmt: skip
    h, w = inputs["hidden"], inputs["weight"]
    chosen = fused_methods(device, inputs, TIMED_LOSS_TYPES) if loss_types else build_methods(device, inputs)
    methods = {"matmul": lambda: h.detach() @ w.detach().t(), **chosen}
    samples: dict[str, list[dict]] = {name: [] for name in methods}
    failed: dict[str, str] = {}  # a comparison method (a peer library's) that raised: recorded, then left out
    for r in range(warmup + repeats):
        for name, method in methods.items():  # interleaved, so all methods see the same machine load
            if name in failed:
                continue
            try:
                s = measure(name, method, inputs, probe, device)
            except Exception as e:  # noqa: BLE001 - a peer's failure must not cost the library's measurements
                if name == "matmul" or name.startswith("fused"):
                    raise
                failed[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                print(f"  [{r}] {name:28s} FAILED, left out: {failed[name]}", flush=True)
                continue
            if r >= warmup:
                samples[name].append(s)
            print(f"  [{r}] {name:28s} " + " ".join(f"{k}={v:.4g}" for k, v in s.items()), flush=True)
    matmul_s = statistics.median(s["fwd"] for s in samples["matmul"])
    matmul_cpu_s = statistics.median(s["fwd_cpu"] for s in samples["matmul"])
    out = {"tokens": T, "hidden": H, "vocab": V, "dtype": str(dtype).removeprefix("torch."), "device": device.type}
    out.update(calibration=calibration, matmul_s=matmul_s, matmul_cpu_s=matmul_cpu_s)
    rows = {
        name: {**summarise(ss, matmul_s, matmul_cpu_s), "loss_type": chosen[name].loss_type}
        for name, ss in samples.items()
        if name != "matmul" and ss
    }
    out["failed_methods"] = failed
    naive = rows.get("naive")
    for row in rows.values():
        if naive:  # (at a toy shape the probe can see no memory at all: no ratio then)
            for key, name in (("peak_extra_bytes", "peak_vs_naive"), ("workspace_bytes", "workspace_vs_naive")):
                if naive[key] > 0:
                    row[name] = row[key] / naive[key]
    for name, row in rows.items():  # each loss type over dapo on the same path
        dapo = rows.get(chosen[name].path) if chosen[name].path is not None else None
        if dapo is not None and loss_types:
            row["vs_dapo"] = {k: row[k] / dapo[k] for k in ("fwd_bwd_s", "fwd_bwd_cpu_s", "workspace_bytes")}
            row["vs_dapo"]["peak_extra_bytes"] = row["peak_extra_bytes"] / dapo["peak_extra_bytes"]
    out["methods"] = rows
    return out


def table(results: list[dict]) -> str:
    lines = []
    for res in results:
        lines.append(
            f"T={res['tokens']} H={res['hidden']} V={res['vocab']} {res['dtype']} on {res['device']}: "
            f"matmul {res['matmul_s'] * 1e3:.1f} ms wall, {res['matmul_cpu_s'] * 1e3:.1f} ms CPU"
        )
        lines.append(
            "| method | fwd (ms) | bwd (ms) | fwd+bwd (ms) | x matmul (wall) | x matmul (CPU time) "
            "| fwd working (MB) | bwd working (MB) | working vs naive |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, r in res["methods"].items():
            vs = f"{r['workspace_vs_naive']:.1%}" if "workspace_vs_naive" in r else "-"
            if "vs_dapo" in r:
                d = r["vs_dapo"]
                vs = f"x dapo: time {d['fwd_bwd_s']:.3f} (CPU {d['fwd_bwd_cpu_s']:.3f})"
                vs += f", peak {d['peak_extra_bytes']:.3f}"
            lines.append(
                f"| {name} | {r['fwd_s'] * 1e3:.0f} | {r['bwd_s'] * 1e3:.0f} | {r['fwd_bwd_s'] * 1e3:.0f} | "
                f"{r['fwd_bwd_matmuls']:.2f} | {r['fwd_bwd_matmuls_cpu']:.2f} | "
                f"{r['fwd_work_bytes'] / 1e6:.0f} | {r['bwd_work_bytes'] / 1e6:.0f} | {vs} |"
            )
    return "\n".join(lines)


def plot(results: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(13, 4.5 * len(results)), squeeze=False)
    for (ax_t, ax_m), res in zip(axes, results):
        names = list(res["methods"])
        rows = [res["methods"][n] for n in names]
        x = list(range(len(names)))
        fwd = [r["fwd_s"] for r in rows]
        ax_t.bar(x, fwd, label="forward")
        ax_t.bar(x, [r["bwd_s"] for r in rows], bottom=fwd, label="backward")
        ax_t.axhline(res["matmul_s"], color="k", ls="--", lw=1, label="one [T,H]x[H,V] matmul")
        ax_t.set_xticks(x, names, rotation=15)
        ax_t.set_ylabel("seconds (median)")
        ax_t.legend()
        title = f"T={res['tokens']} H={res['hidden']} V={res['vocab']} {res['dtype']} ({res['device']})"
        ax_t.set_title("time, " + title)
        width = 0.4
        for shift, key, label in ((-width / 2, "fwd_work_bytes", "forward"), (width / 2, "bwd_work_bytes", "backward")):
            ax_m.bar([i + shift for i in x], [r[key] / 1e9 for r in rows], width, label=f"{label} working memory")
        ax_m.set_xticks(x, names, rotation=15)
        ax_m.set_ylabel("GB (peak less the returned gradients)")
        ax_m.legend()
        ax_m.set_title("working memory, " + title)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tokens", type=count(1), default=None, help="T (default 2048; on CUDA also 16384)")
    ap.add_argument("--hidden", type=count(1), default=None, help="H (default 896; 1536 for the large CUDA case)")
    ap.add_argument("--vocab", type=count(1), default=151_936, help="V")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: fp32 on CPU")
    ap.add_argument("--repeats", type=count(1), default=3)
    ap.add_argument("--warmup", type=count(0), default=None, help="untimed rounds (default 0 on CPU, 2 on CUDA)")
    ap.add_argument("--out", type=pathlib.Path, help="the JSON; the PNG next to it (default: in benchmarks/runs/)")
    ap.add_argument("--loss-types", action="store_true", help="TRL's loss types on the fused paths, against dapo")
    ap.add_argument("--seq-len", type=count(1), default=SEQ_LEN, help=f"tokens per sequence (default {SEQ_LEN})")
    args = ap.parse_args()
    set_seq_len(args.seq_len)
    if args.out is not None:
        check_output_file(ap, "--out", args.out)
    if args.tokens is not None and args.tokens % SEQ_LEN:
        ap.error(f"--tokens must be a multiple of {SEQ_LEN} (the benchmark's sequence length), got {args.tokens}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    warmup = args.warmup if args.warmup is not None else (2 if device.type == "cuda" else 0)
    name = "loss_types" if args.loss_types else "loss"
    out = out_file(args.out, benchmark=name.replace("_", "-"), filename=f"{name}.json", prog="bench_loss.py")
    if args.tokens is None and args.hidden is None and args.dtype is None and device.type == "cuda":
        configs = [(2048, 896, args.vocab, "float32"), (16_384, 1536, args.vocab, "bfloat16")]
    else:
        configs = [(args.tokens or 2048, args.hidden or 896, args.vocab, args.dtype or "float32")]
    results = [
        run_config(T, H, V, getattr(torch, dt), device, args.repeats, warmup, args.loss_types)
        for T, H, V, dt in configs
    ]  # fmt: skip
    meta = {
        **run_metadata(device=args.device),
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "repeats": args.repeats,
        "warmup": warmup,
        "options": OPTIONS,
        "seq_len": SEQ_LEN,
        "loss_types": {t: loss_options(t) for t in (TIMED_LOSS_TYPES if args.loss_types else ("dapo", KIT_LOSS_TYPE))},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"meta": meta, "results": results})
    png = out.with_suffix(".png")
    plot(results, png)
    print("\n" + table(results))
    print(f"\nwrote {out} and {png}")


if __name__ == "__main__":
    main()
