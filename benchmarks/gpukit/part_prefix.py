"""Part ``e2e``'s prefix-sharing measurement (called from :func:`gpukit.part_e2e.run`): a few questions' completions
packed as the trainer packs them with ``prefix_sharing`` on (each prompt once, block-causal mask, the attention
:func:`cppo.step.models.attn_implementation` picks for it: flex_attention on CUDA) and off (a prompt copy per
completion, the attention picked without it: flash-attention 2 or sdpa), the same seeded weights either way. Recorded:
the error of the shared final hidden states and log-probs at the completion rows against the unshared ones, a negative
control (the shared row without its mask: sibling completions see each other), the tokens through the model each
way, and forward+backward wall time and peak memory each way. Checked: the equality only."""

from __future__ import annotations

import dataclasses
import statistics
import time

from gpukit.plan import Plan


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The questions drawn (seeded), each range inclusive, and the timing's repeats after its warm-ups."""

    questions: int
    prompt: tuple[int, int]  # prompt tokens
    completions: tuple[int, int]  # completions per question
    completion: tuple[int, int]  # tokens per completion
    repeats: int
    warmup: int


#: On a GPU prompts of a GSM8K-like question, G' = 2-8 kept completions; the dry run the same code tiny (on its
#: seed: 5 completions of 5-6 tokens after 2 prompts). The first warm-up on CUDA includes flex_attention's compilation.
SIZES = {
    "gpu": Sizes(questions=4, prompt=(150, 200), completions=(2, 8), completion=(20, 300), repeats=5, warmup=2),
    "dry": Sizes(questions=2, prompt=(6, 10), completions=(2, 3), completion=(1, 6), repeats=2, warmup=1),
}
#: ||shared - unshared|| / ||unshared|| of the completion rows' final hidden states allowed per dtype. Measured on
#: CPU (sdpa both ways): fp32 4.6e-7 at the GPU sizes and model, 2.3e-8 on the dry run; bf16 5.0e-3 at the GPU
#: sizes. fp32 1e-4, 200x that, leaves room for different attention kernels either side on CUDA (flex_attention
#: against flash-attention 2 / sdpa), as the packed forward's check (tests/cppo/step/test_cuda_models.py); bf16 2e-2,
#: 4x the CPU's. The negative control (a leak between completions) gave 0.97 and 0.22.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def draw_samples(sizes: Sizes, vocab_size: int, seed: int = 0) -> list:
    """``sizes.questions`` random prompts, each with its random completions (token ids in ``[5, vocab_size)``),
    shuffled: pruning leaves the questions' completions interleaved."""
    import torch

    from cppo.step import Sample

    g = torch.Generator().manual_seed(seed)

    def uniform(lo_hi: tuple[int, int]) -> int:
        return int(torch.randint(lo_hi[0], lo_hi[1] + 1, (), generator=g))

    def tokens(n: int) -> list[int]:
        return torch.randint(5, vocab_size, (n,), generator=g).tolist()

    prompts = [tokens(uniform(sizes.prompt)) for _ in range(sizes.questions)]
    layout = [q for q in range(sizes.questions) for _ in range(uniform(sizes.completions))]
    order = torch.randperm(len(layout), generator=g).tolist()
    return [Sample(prompts[layout[i]], tokens(uniform(sizes.completion)), 0.0) for i in order]


def completion_rows(model, batches, *, masked: bool = True) -> dict:
    """Each sample's final hidden states ``[c, H]`` at the rows that predict its completion tokens, by sample index,
    over ``batches``; ``masked=False`` runs a shared row without its block mask (the negative control)."""
    from cppo.step import completion_hidden

    out = {}
    for b in batches:
        hidden = completion_hidden(model, b.input_ids, b.position_ids, b.predict_index, b.prefix if masked else None)
        out.update(zip(b.sample_index, hidden.split((b.cu_seqlens[1:] - b.cu_seqlens[:-1]).tolist())))
    return out


def token_logprobs(model, hidden, targets):
    """fp64 log-probs ``[T]`` of ``targets [T]`` from ``hidden [T, H]`` through the model's LM head."""
    import torch

    from cppo.step import lm_head

    weight, bias = lm_head(model)
    logits = hidden.double() @ weight.double().T + (0 if bias is None else bias.double())  # [T, V]
    return torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]


def errors(models: list, shared: list, unshared: list, samples: list) -> dict:
    """The shared rows (``models[0]``, ``shared`` micro-batches) against the unshared ones (``models[1]``, the same
    weights) without grad: the final hidden states' relative (norm) and largest absolute error, the log-probs'
    largest absolute and relative error, and the negative control's relative error."""
    import torch

    with torch.no_grad():
        rows = [
            completion_rows(models[0], shared),
            completion_rows(models[1], unshared),
            completion_rows(models[0], shared, masked=False),
        ]
    got, want, leak = (torch.cat([r[i] for i in range(len(samples))]).double() for r in rows)  # [T, H] each
    targets = torch.tensor([t for s in samples for t in s.completion_ids], device=got.device)  # [T]
    logp_got, logp_want = token_logprobs(models[0], got, targets), token_logprobs(models[1], want, targets)  # [T]
    return {
        "error": ((got - want).norm() / want.norm()).item(),
        "max_abs_error": (got - want).abs().max().item(),
        "logprob_max_abs_error": (logp_got - logp_want).abs().max().item(),
        "logprob_max_rel_error": ((logp_got - logp_want).abs() / logp_want.abs()).max().item(),
        "control_error": ((leak - want).norm() / want.norm()).item(),
    }


def fwd_bwd(model, batches: list, upstream: dict) -> None:
    """One training pass as the trainer's: per micro-batch, the completion tokens' log-probs (fp32 head) and
    ``sum(logp * upstream)`` (``upstream``: a random ``[c]`` per sample index) backward, into fresh gradients."""
    import torch

    from cppo.step import completion_hidden, lm_head

    model.zero_grad(set_to_none=True)
    weight, bias = lm_head(model)
    for b in batches:
        hidden = completion_hidden(model, b.input_ids, b.position_ids, b.predict_index, b.prefix)  # [T, H]
        logits = hidden.float() @ weight.float().T + (0 if bias is None else bias.float())  # [T, V]
        logp = torch.log_softmax(logits, -1).gather(1, b.targets[:, None])[:, 0]  # [T]
        (logp * torch.cat([upstream[i] for i in b.sample_index])).sum().backward()


def timed(model, batches: list, upstream: dict, sizes: Sizes, device) -> tuple[float, float | None]:
    """``(median seconds of a forward+backward after the warm-ups, peak GB above what was held before on CUDA or
    None)``; the device synchronised around each pass."""
    import torch

    cuda = device.type == "cuda"
    for _ in range(sizes.warmup):
        fwd_bwd(model, batches, upstream)
    seconds = []
    if cuda:
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(sizes.repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fwd_bwd(model, batches, upstream)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - held) / 2**30 if cuda else None
    return statistics.median(seconds), peak


def prefix_shared(plan: Plan, dtype: str, sizes: Sizes | None = None) -> dict:
    """The plan's packed model (tiny Qwen2) with prefix sharing and without (as the trainer loads and packs each,
    micro_batch_tokens at its default) on the questions of ``sizes`` (:data:`SIZES` by default): the errors of
    :func:`errors`, tokens through the model each way and their ratio, forward+backward seconds and peak GB each
    way (:func:`timed`), and :data:`TOLERANCE`'s bound."""
    import torch

    from cppo.config import TrainConfig
    from cppo.step import load_model_and_tokenizer, pack_all, pack_shared

    sizes = sizes or SIZES["dry" if plan.dry else "gpu"]
    device = torch.device(plan.device)
    budget = {f.name: f.default for f in dataclasses.fields(TrainConfig)}["micro_batch_tokens"]
    models = [
        load_model_and_tokenizer("tiny-qwen2", model_config=plan.packed_model, dtype=dtype, device=device,
                                 prefix_sharing=sharing)[0].train()
        for sharing in (True, False)
    ]  # fmt: skip
    samples = draw_samples(sizes, plan.packed_model["vocab_size"])
    shared, unshared = pack_shared(samples, budget, device=device), pack_all(samples, budget, device=device)
    g = torch.Generator().manual_seed(1)
    upstream = {i: torch.randn(len(s.completion_ids), generator=g).to(device) for i, s in enumerate(samples)}
    row = {"dtype": dtype, "attn_implementation": [getattr(m.config, "_attn_implementation", None) for m in models]}
    row |= {"lengths": [[len(s.prompt_ids), len(s.completion_ids)] for s in samples], "tolerance": TOLERANCE[dtype]}
    row |= errors(models, shared, unshared, samples)
    tokens = [sum(b.num_input_tokens for b in batches) for batches in (shared, unshared)]
    row |= {"tokens_shared": tokens[0], "tokens_unshared": tokens[1], "token_ratio": tokens[1] / tokens[0]}
    row |= {"micro_batches_shared": len(shared), "micro_batches_unshared": len(unshared)}
    for name, model, batches in (("shared", models[0], shared), ("unshared", models[1], unshared)):
        row[f"fwd_bwd_s_{name}"], row[f"peak_extra_gb_{name}"] = timed(model, batches, upstream, sizes, device)
    row["speedup"] = row["fwd_bwd_s_unshared"] / row["fwd_bwd_s_shared"]
    return row
