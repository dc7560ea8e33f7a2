"""Part ``loss``: every method of ``bench_loss.build_methods`` (forward + backward) at the plan's shapes against the
plain ``[T,H] x [H,V]`` GEMM timed in the same run (ms, TFLOP/s, peak memory), with each method's loss and
``fused_logprobs`` compared with a float64 oracle. The kit records those errors; whether they are within the
kernels' error bound at these shapes is a test, ``tests/kernels/test_cuda_kernels.py``'s
``test_the_loss_at_the_kits_shapes_matches_the_fp64_oracle``, run by the ``tests`` part."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys

from gpukit import roofline
from gpukit.plan import Plan
from gpukit.runner import Report, seconds_left

#: Method-name prefixes of ``bench_loss``'s reference points; every other method is the library's own.
COMPARISONS = ("naive", "liger")


def mask_broken(*modules: str) -> dict[str, str]:
    """Optional modules that are installed but fail to import with something other than ImportError (a carried wheel
    built for other versions) are set to None in ``sys.modules``, so that later imports raise ImportError and
    ``bench_loss``'s ``except ImportError`` skips their methods instead of the whole part failing."""
    broken = {}
    for name in modules:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            pass
        except Exception as e:  # noqa: BLE001 - any failure of an optional package
            broken[name] = f"{type(e).__name__}: {e}"[:300]
            sys.modules[name] = None  # type: ignore[assignment]
    return broken


def oracle_errors(inputs: dict, *, chunk: int = 1024) -> dict:
    """The float64 oracle at a benchmark shape (``bench_loss.make_inputs``'s inputs), ``chunk`` tokens at a time:
    ``logp_error``, the largest |fused_logprobs - fp64 log-prob| (the default backend: Triton on CUDA), and
    ``loss64``, the fp64 loss with ``bench_loss.OPTIONS``, and ``loss64_<type>`` with ``bench_loss.KIT_LOSS_TYPE``'s
    options on top."""
    import bench_loss
    import torch

    from cppo_kernels import LossConfig, fused_logprobs, reference, use_backend

    h, w, t = inputs["hidden"].detach(), inputs["weight"].detach(), inputs["targets"]
    w64 = w.double()  # [V, H]
    logp64 = torch.empty(h.shape[0], dtype=torch.float64, device=h.device)  # [T]
    with torch.no_grad():
        for a in range(0, h.shape[0], chunk):
            logp64[a : a + chunk] = reference.token_logprobs(h[a : a + chunk].double(), w64, t[a : a + chunk])[0]
        del w64
        with use_backend("auto"):
            got = fused_logprobs(h, w, t)  # [T] fp32
        out = {"logp_error": (got.double() - logp64).abs().max().item()}
        for loss_type in ("dapo", bench_loss.KIT_LOSS_TYPE):
            loss64, _ = reference.policy_loss(
                logp64, inputs["adv"].double(), inputs["cu"], old_logprobs=inputs["old"].double(),
                ref_logprobs=inputs["ref"].double(),
                config=LossConfig(**{**bench_loss.OPTIONS, **bench_loss.LOSS_TYPES[loss_type]}),
            )  # fmt: skip
            out["loss64" if loss_type == "dapo" else f"loss64_{loss_type}"] = loss64.item()
    return out


def _oracle_key(name: str) -> str:
    """The :func:`oracle_errors` loss a method is compared with: its loss type's."""
    import bench_loss

    loss_type = bench_loss.loss_type_of(name)
    return "loss64" if loss_type == "dapo" else f"loss64_{loss_type}"


def measure_bandwidth(device, *, gigabytes: float = 2.0, repeats: int = 5) -> float:
    """Bytes/s of a device-to-device copy of ``gigabytes`` (read + write counted), the median of ``repeats`` after a
    warm-up: the bandwidth the roofline uses (``roofline.PEAK_BANDWIDTH`` on the CPU, where nothing is measured)."""
    import statistics

    import torch

    if device.type != "cuda":
        return roofline.PEAK_BANDWIDTH["H200"]
    n = int(gigabytes * 1e9 / 4)
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    times = []
    for r in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        if r:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * n * 4 / statistics.median(times)


def loss_summary(res: dict, accuracy: dict, bandwidth: float | None = None) -> dict:
    """``bench_loss.run_config``'s result in the kit's terms. FLOPs are counted as the three GEMMs any method needs
    (logits, dhidden, dweight: ``6 T H V``), so TFLOP/s ranks the methods, and ``x_gemm_floor`` is the time over
    three plain GEMMs of the same shape measured in the same run (1.0 = as fast as the floor). With ``bandwidth``
    (bytes/s), each method's roofline prediction (:mod:`gpukit.roofline`: its ledger at this shape, this GEMM rate
    and bandwidth) and the measured time over it."""
    import torch

    T, H, V = res["tokens"], res["hidden"], res["vocab"]
    gemm_s, gemm_flop = res["matmul_s"], 2 * T * H * V
    predicted = {}
    if bandwidth:
        predicted = roofline.roofline(list(res["methods"]), T, H, V, getattr(torch, res["dtype"]),
                                      gemm_ms=gemm_s * 1e3, bandwidth=bandwidth)  # fmt: skip
    methods = {}
    for name, row in res["methods"].items():
        seconds = row["fwd_bwd_s"]
        pred = predicted.get(name, {}).get("predicted_ms")
        methods[name] = {
            "fwd_ms": row["fwd_s"] * 1e3,
            "bwd_ms": row["bwd_s"] * 1e3,
            "fwd_bwd_ms": seconds * 1e3,
            "tflops": 3 * gemm_flop / seconds / 1e12,
            "x_gemm_floor": seconds / (3 * gemm_s),
            "peak_extra_gb": row["peak_extra_bytes"] / 1e9,
            "workspace_gb": row["workspace_bytes"] / 1e9,
            "loss": row["loss"],
            "loss_error": abs(row["loss"] - accuracy[_oracle_key(name)]),
            "library": not name.startswith(COMPARISONS),
            "predicted_ms": pred,
            "x_predicted": None if not pred else seconds * 1e3 / pred,
        }
    library = [n for n, m in methods.items() if m["library"]]
    fastest = min(methods, key=lambda n: methods[n]["fwd_bwd_ms"]) if methods else None
    return {
        "gemm": {"ms": gemm_s * 1e3, "tflops": gemm_flop / gemm_s / 1e12},
        "bandwidth_tbs": None if not bandwidth else bandwidth / 1e12,
        "methods": methods,
        "fastest": fastest,
        "fastest_library": min(library, key=lambda n: methods[n]["fwd_bwd_ms"]) if library else None,
        "accuracy": accuracy,
        "bench_loss": res,
    }


def run(plan: Plan, out: pathlib.Path, report: Report, until: float) -> None:
    """Each shape: the fp64 oracle's numbers, then ``bench_loss.run_config`` (every method and the GEMM,
    interleaved); the check that every method was timed, the library's among them."""
    import torch

    report.add("masked_optional_modules", mask_broken("liger_kernel.chunked_loss", "liger_kernel.transformers"))
    import bench_loss

    device = torch.device(plan.device)
    for T, H, V, dtype_name in plan.loss_shapes:
        seconds_left(until)
        key = f"T={T} H={H} V={V} {dtype_name}"
        dtype = getattr(torch, dtype_name)
        accuracy = oracle_errors(bench_loss.make_inputs(T, H, V, dtype, device))
        bandwidth = measure_bandwidth(device)
        res = bench_loss.run_config(T, H, V, dtype, device, plan.loss_repeats, plan.loss_warmup)
        row = loss_summary(res, accuracy, bandwidth)
        methods = row["methods"]
        timed = row["gemm"]["ms"] > 0 and all(m["fwd_bwd_ms"] > 0 for m in methods.values())
        report.check(
            f"{key}: every method of bench_loss timed, the library's among them",
            timed and any(m["library"] for m in methods.values()),
            f"{len(methods)} methods: {', '.join(methods)}",
        )
        if row["bench_loss"].get("failed_methods"):  # a peer's failure is recorded, not ours to fail on
            report.add(f"{key}: comparison methods that raised (left out)", row["bench_loss"]["failed_methods"])
        report.add(key, row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
