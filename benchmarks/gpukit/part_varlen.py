"""Part ``e2e``'s varlen measurement (called from :func:`gpukit.part_e2e.run`): torch's own varlen FlashAttention
(``torch_varlen``, ``cppo/step/varlen_attention.py``, what the packed forward runs on CUDA without the flash-attn
wheel) on one packed row against each sequence's separate sdpa forward, its negative control (position_ids running
on: one causal sequence), and the forward+backward time and peak memory of the packed row against sdpa's padded
batch of the same sequences (a 2-D mask, what a trainer without packing runs) and sdpa's packed row (its
block-diagonal ``[L, L]`` mask). On a GPU where varlen_attn runs: the kernel, bf16. The dry run: the same code on the
CPU in fp32 with the module's reference kernel registered in its place (``REFERENCE_KERNEL``, per-sequence sdpa):
the plumbing, no measurement. Checked: the equality, the control, and that no call fell back to sdpa."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import statistics
import time
import warnings

from gpukit.plan import Plan


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The timing's sequences (seeded lengths, inclusive range), its model's shape and its repeats after warm-ups."""

    sequences: int
    length: tuple[int, int]
    model: dict
    repeats: int
    warmup: int


#: On a GPU 16 completions of 64-1,024 tokens through two decoder layers of Qwen2.5-1.5B's shape (head dim 128,
#: 12 query heads on 2 KV heads); the dry run tiny.
SIZES = {
    "gpu": Sizes(sequences=16, length=(64, 1024), repeats=5, warmup=2, model={
        "vocab_size": 1024, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 2,
        "num_attention_heads": 12, "num_key_value_heads": 2,
    }),
    "dry": Sizes(sequences=3, length=(2, 9), repeats=1, warmup=0, model={
        "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2,
    }),
}  # fmt: skip
#: ||packed - alone|| / ||alone|| allowed per dtype: as the packed forward's check
#: (tests/cppo/step/test_cuda_models.py), different attention kernels either side (the FlashAttention kernel
#: packed, sdpa alone); a leak gives O(0.1-1).
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
#: The name the dry run registers the reference kernel under.
DRY_NAME = "torch_varlen_reference"


def attention_name(plan: Plan):
    """``(implementation name, kernel description, dtype)`` this run measures, or a string saying why none."""
    import torch

    from cppo.step import REFERENCE_KERNEL, register_varlen_attention, varlen_available

    if plan.dry:
        return register_varlen_attention(DRY_NAME, REFERENCE_KERNEL), "reference (per-sequence sdpa)", "float32"
    if not varlen_available(torch.device(plan.device)):
        return f"skipped: torch {torch.__version__} has no varlen_attn, or the GPU is older than compute capability 8.0"
    return register_varlen_attention(), "torch.nn.attention.varlen.varlen_attn", "bfloat16"


def tiny_model(config: dict, dtype: str, device):
    from cppo.step import load_model_and_tokenizer

    return load_model_and_tokenizer("tiny-qwen2", model_config=config, dtype=dtype, device=device)[0]


def hidden(model, ids, position_ids, mask=None):
    """Final hidden states ``[B, L, H]`` of the decoder (no cache)."""
    from cppo.step import decoder

    return decoder(model)(input_ids=ids, position_ids=position_ids, attention_mask=mask, use_cache=False)[0]


def errors(model, name: str, lengths, device) -> dict:
    """The packed row through ``name`` against each sequence alone through sdpa: the relative errors, their largest
    (``error``), the negative control's largest past the first sequence (``control_error``)."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, model.config.vocab_size, (1, sum(lengths)), generator=g).to(device)  # [1, L]
    restart = torch.cat([torch.arange(n) for n in lengths])[None].to(device)  # [1, L]
    running = torch.arange(sum(lengths), device=device)[None]  # [1, L]
    bounds = list(itertools.accumulate(lengths, initial=0))
    with torch.no_grad():
        model.set_attn_implementation(name)
        packed, control = hidden(model, ids, restart)[0].double(), hidden(model, ids, running)[0].double()  # [L, H]
        model.set_attn_implementation("sdpa")
        alone = [hidden(model, ids[:, a:b], restart[:, a:b])[0].double() for a, b in zip(bounds, bounds[1:])]
    errs = [((packed[a:b] - x).norm() / x.norm()).item() for (a, b), x in zip(zip(bounds, bounds[1:]), alone)]
    leaks = [((control[a:b] - x).norm() / x.norm()).item() for (a, b), x in zip(zip(bounds, bounds[1:]), alone)]
    return {"lengths": list(lengths), "error": max(errs), "errors": errs, "control_error": max(leaks[1:])}


def timed(step, sizes: Sizes, device) -> tuple[float, float | None]:
    """``(median seconds of step() after the warm-ups, peak GB above what was held before on CUDA or None)``."""
    import torch

    cuda = device.type == "cuda"
    for _ in range(sizes.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(sizes.repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), (torch.cuda.max_memory_allocated() - held) / 2**30 if cuda else None


def timings(model, name: str, sizes: Sizes, device) -> dict:
    """Forward+backward (``sum(hidden * upstream)``, the real tokens' rows) of :data:`SIZES`' sequences: packed
    through ``name``, as a right-padded batch through sdpa (a 2-D mask) and packed through sdpa (its block mask)."""
    import torch

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(sizes.length[0], sizes.length[1] + 1, (sizes.sequences,), generator=g).tolist()
    ids = [torch.randint(5, model.config.vocab_size, (n,), generator=g) for n in lengths]
    packed_ids, restart = torch.cat(ids)[None].to(device), torch.cat([torch.arange(n) for n in lengths])[None]
    restart = restart.to(device)  # [1, T]
    longest = max(lengths)
    padded = torch.zeros(len(lengths), longest, dtype=torch.long)  # [S, Lmax]
    mask = torch.zeros_like(padded)  # [S, Lmax]
    for row, x in enumerate(ids):
        padded[row, : len(x)], mask[row, : len(x)] = x, 1
    padded, mask = padded.to(device), mask.to(device).bool()
    positions = torch.arange(longest, device=device).expand(len(lengths), -1)  # [S, Lmax]
    up = torch.randn(sum(lengths), model.config.hidden_size, generator=g).to(device, model.dtype)  # [T, H]

    def packed_step():
        model.zero_grad(set_to_none=True)
        (hidden(model, packed_ids, restart)[0] * up).sum().backward()

    def padded_step():
        model.zero_grad(set_to_none=True)
        (hidden(model, padded, positions, mask)[mask] * up).sum().backward()

    row = {"timing_lengths": lengths, "tokens_packed": sum(lengths), "tokens_padded": longest * len(lengths)}
    for key, implementation, step in (("varlen", name, packed_step), ("sdpa_padded", "sdpa", padded_step),
                                      ("sdpa_packed", "sdpa", packed_step)):  # fmt: skip
        model.set_attn_implementation(implementation)
        row[f"fwd_bwd_s_{key}"], row[f"peak_extra_gb_{key}"] = timed(step, sizes, device)
    row["speedup_vs_sdpa_padded"] = row["fwd_bwd_s_sdpa_padded"] / row["fwd_bwd_s_varlen"]
    row["speedup_vs_sdpa_packed"] = row["fwd_bwd_s_sdpa_packed"] / row["fwd_bwd_s_varlen"]
    return row


def varlen_packed(plan: Plan, sizes: Sizes | None = None) -> dict | str:
    """The measurement's row (errors, control, timings, the fallback warnings seen), or why it was skipped."""
    import torch

    chosen = attention_name(plan)
    if isinstance(chosen, str):
        return chosen
    name, kernel, dtype = chosen
    sizes = sizes or SIZES["dry" if plan.dry else "gpu"]
    device = torch.device(plan.device)
    row = {"attn_implementation": name, "kernel": kernel, "dtype": dtype, "tolerance": TOLERANCE[dtype]}
    row |= {"flash_attn_installed": importlib.util.find_spec("flash_attn") is not None}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        row |= errors(tiny_model(plan.packed_model, dtype, device).eval(), name, plan.packed_lengths, device)
        row |= timings(tiny_model(sizes.model, dtype, device).train(), name, sizes, device)
    row["fallbacks"] = sorted({str(w.message) for w in seen if "runs sdpa" in str(w.message)})
    return row


def record(plan: Plan, report) -> None:
    """Records :func:`varlen_packed`'s row as the result ``varlen`` and checks it: the equality within
    :data:`TOLERANCE`, the negative control above 10x it, no call run by sdpa instead. An exception is recorded as
    a failed check, and the part goes on."""
    try:
        row = varlen_packed(plan)
    except Exception as err:  # noqa: BLE001  (recorded; the speedup runs still run)
        report.add("varlen", f"error: {type(err).__name__}: {err}")
        report.check("torch_varlen packed forward runs", False, f"{type(err).__name__}: {str(err)[:300]}")
        return
    report.add("varlen", row)
    if isinstance(row, str):
        return
    what = f"{row['attn_implementation']} ({row['kernel']}, {row['dtype']})"
    tol = row["tolerance"]
    report.check(f"{what}: packed hidden states equal separate sdpa forwards", row["error"] <= tol,
                 f"max relative error {row['error']:.2g}, tolerance {tol:g}")  # fmt: skip
    report.check(f"{what}: the negative control (one causal sequence) leaks", row["control_error"] > 10 * tol,
                 f"control error {row['control_error']:.2g}")  # fmt: skip
    report.check(f"{what}: no call ran sdpa instead", not row["fallbacks"], "; ".join(row["fallbacks"]))
