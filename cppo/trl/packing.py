"""Prefix sharing for :class:`cppo.trl.CPPOTrainer`: TRL's padded rows packed with each prompt once.

TRL 1.16 runs its old-policy, reference and policy passes on ``[B, P + C]`` rows (prompts padded on the left,
completions on the right), so a question's prompt is computed once per kept completion. Here the rows become
:class:`cppo.step.packing.Sample` s (unpadded prompt and completion ids; rows with identical prompts share one prompt),
:func:`cppo.step.packing.pack_shared` packs them (block-causal mask: each completion sees its prompt and itself,
position ids continuing from the prompt), and the hidden states of the positions that predict completion tokens are put
back into TRL's ``[B, C, H]`` layout (zeros at masked positions). The same downstream code then runs:
``fused_cppo_loss`` for the policy, the LM head (``fused_logprobs``, TRL's temperature and ``cast_lm_head_to_fp32``) for
the old-policy and reference log-probs, zero at masked positions as TRL's are.

The hidden states equal the padded layout's within float rounding: a completion attends to the same tokens, and its
rotary positions are those of the padded row shifted by the row's left padding (attention depends only on position
differences). The budget of a packed row is the padded layout's tokens per forward, so a pass never holds more
token activations than TRL's, and at most :data:`MAX_ROW_TOKENS` (or one padded row), so that a dense mask's L^2
attention scores stay bounded.

Processes pack their own rows, so one may need more packed forwards than another (longer prompts). A DDP forward is a
collective (it broadcasts the buffers), so every process runs as many: :func:`trainer_rows` agrees on the count and
adds weight-0 filler passes (repeats of the process's smallest packed row, as the cppo trainer's fillers), or, when
some process cannot pack its rows, every process runs TRL's padded rows.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cppo_kernels import fused_logprobs

from ..step import PackedBatch, Sample, pack_shared, prefix_attention_mask, use_prefix_sharing
from .loss import head_inputs, install_hidden_forward

#: The longest packed row (unless one padded row is longer): sdpa and eager take a dense ``[L, L]`` mask and compute
#: every score of it, so L is bounded as the cppo trainer's default ``micro_batch_tokens`` bounds its rows.
MAX_ROW_TOKENS = 4096

__all__ = ["SharedRows", "prefix_sharing_possible", "trainer_rows", "shared_rows", "shared_hidden", "shared_logps"]


@dataclass
class SharedRows:
    """TRL's ``[B, C]`` completion layout as prefix-shared packed rows: ``dest[k] [T_k]`` are the flat indices into
    ``[B * C]`` of ``batches[k]``'s completion tokens (their targets, in order). ``fillers``: passes run after them
    whose results are discarded (weight 0), so that every process runs as many forwards (:func:`trainer_rows`)."""

    batches: list[PackedBatch]
    dest: list[Tensor]
    shape: tuple[int, int]
    fillers: list[PackedBatch] = field(default_factory=list)

    @property
    def num_input_tokens(self) -> int:
        """Positions the model runs on for one pass over these rows (each prompt once per packed row); the policy
        passes over TRL's shuffled ``steps_per_generation`` split of them may share fewer prompts."""
        return sum(b.num_input_tokens for b in self.batches)


def prefix_sharing_possible(trainer) -> bool:
    """Whether ``trainer`` (a ``CPPOTrainer``, once built) may run prefix-shared rows: ``prefix_sharing`` asked for,
    the fused loss runs (TRL's own loss takes its padded rows), and the policy (and reference model) take the mask,
    else one warning naming ``prefix_sharing`` (:func:`cppo.step.models.use_prefix_sharing`) and TRL's padded rows. The
    reference model gets the hidden-state forward the policy has (:func:`cppo.trl.loss.install_hidden_forward`)."""
    if not trainer.args.prefix_sharing or trainer.fused_loss_refused is not None:
        return False
    if trainer.aux_loss_enabled:  # TRL's load-balancing loss counts each row's prompt tokens: padded rows
        warnings.warn(
            "CPPOTrainer: prefix_sharing=True is not used with router_aux_loss_coef (the mixture-of-experts "
            "load-balancing loss counts every row's prompt tokens, as TRL's padded rows do)",
            stacklevel=3,
        )
        return False
    ref = None if trainer.ref_model is None else trainer.accelerator.unwrap_model(trainer.ref_model)
    if not all(use_prefix_sharing(m, True) for m in (trainer.model, ref) if m is not None):
        return False
    if ref is not None:
        install_hidden_forward(ref)
    return True


def trainer_rows(trainer, batch: dict) -> SharedRows | None:
    """``batch``'s rows packed with each prompt once for ``trainer``'s passes (at most the tokens of one padded
    forward of ``per_device_train_batch_size`` rows each), or None for TRL's padded rows: no sharing, TRL's own loss
    (set after the trainer is built too), or rows no packing reproduces (on any process: then every process runs
    its padded rows, one forward per ``per_device_train_batch_size`` rows, as many on each). With several processes
    the packed rows get :attr:`SharedRows.fillers` up to the largest count of any process (one gather)."""
    if not trainer.prefix_sharing or trainer.fused_loss_refused is not None:
        return None
    rows = shared_rows(batch, rows_per_forward=trainer.args.per_device_train_batch_size)
    if trainer.accelerator.num_processes == 1:
        return rows
    count = torch.tensor([-1 if rows is None else len(rows.batches)], device=trainer.accelerator.device)
    counts = trainer.accelerator.gather(count)  # [processes]
    if int(counts.min()) < 0:
        return None
    smallest = min(rows.batches, key=lambda b: b.num_input_tokens)
    rows.fillers = [smallest] * (int(counts.max()) - len(rows.batches))
    return rows


def _lengths(mask: Tensor, *, left: bool) -> Tensor | None:
    """``[R]`` lengths of the contiguous runs of ones of a ``[R, W]`` 0/1 mask, padded on the left (``left``) or the
    right; None when some row's ones are not one run at the padded side's far end (no packing reproduces that)."""
    lengths = mask.sum(1)  # [R]
    cols = torch.arange(mask.size(1), device=mask.device)  # [W]
    want = cols >= mask.size(1) - lengths[:, None] if left else cols < lengths[:, None]  # [R, W]
    return lengths if torch.equal(mask.bool(), want) else None


def shared_rows(batch: dict, *, rows_per_forward: int) -> SharedRows | None:
    """The rows of ``batch`` (TRL's layout) packed with each distinct prompt once, in micro-batches of at most the
    tokens of ``rows_per_forward`` padded rows. None when they cannot be (no completion token at all, an empty
    prompt, a mask that is not TRL's padding): the caller then runs the padded layout."""
    prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]  # [B, P], [B, C]
    prompt_len = _lengths(batch["prompt_mask"], left=True)
    completion_len = _lengths(batch["completion_mask"], left=False)
    if prompt_len is None or completion_len is None:
        return None
    rows, width = completion_ids.shape
    keep = [r for r, c in enumerate(completion_len.tolist()) if c > 0]  # rows without a token need no pass
    if not keep or int(prompt_len[keep].min()) < 1:
        return None
    prompts, completions = prompt_ids.tolist(), completion_ids.tolist()
    p_len, c_len = prompt_len.tolist(), completion_len.tolist()
    samples = [Sample(prompts[r][len(prompts[r]) - p_len[r] :], completions[r][: c_len[r]], 0.0) for r in keep]
    padded = prompt_ids.size(1) + width  # >= any sample's p + c - 1
    budget = min(min(rows, rows_per_forward) * padded, max(MAX_ROW_TOKENS, padded))
    batches = pack_shared(samples, budget, device=completion_ids.device)
    kept_rows = torch.tensor(keep, dtype=torch.long, device=completion_ids.device)  # [S]
    dest = [_token_slots(kept_rows[torch.as_tensor(b.sample_index, device=kept_rows.device)], completion_len, width)
            for b in batches]  # fmt: skip
    return SharedRows(batches, dest, (rows, width))


def _token_slots(rows: Tensor, completion_len: Tensor, width: int) -> Tensor:
    """``[T]`` flat indices into ``[B * width]`` of the completion tokens of ``rows [S]``, row after row, token after
    token (row r's token j at ``r * width + j``), without a Python loop over tokens."""
    lengths = completion_len.to(rows.device)[rows]  # [S]
    starts = torch.repeat_interleave(rows * width, lengths)  # [T]
    offsets = torch.arange(starts.numel(), device=rows.device) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths
    )  # [T]: j within its row
    return starts + offsets


def _completion_hidden(model, b: PackedBatch, unwrapped) -> Tensor:
    """``[T, H]`` final hidden states of ``b``'s rows that predict its completion tokens, through ``model`` (its
    ``cppo_hidden_states=True`` forward, whatever wraps it) with the block-causal mask ``unwrapped`` takes."""
    mask = prefix_attention_mask(unwrapped, b.prefix, device=b.input_ids.device)
    hidden = model(input_ids=b.input_ids, position_ids=b.position_ids, attention_mask=mask, cppo_hidden_states=True)
    return hidden[0, b.predict_index]  # [T, H]


def shared_hidden(trainer, model, rows: SharedRows) -> Tensor:
    """``[B, C, H]`` hidden states of the positions that predict each completion token (the padded layout's
    ``hidden[:, P - 1 : P + C - 1]``), zeros at masked positions; differentiable (the policy pass). The fillers'
    forwards join the graph with weight 0 (a DDP backward then sees every forward of this pass used)."""
    unwrapped = trainer.accelerator.unwrap_model(model)
    with trainer.accelerator.autocast():
        parts = [_completion_hidden(model, b, unwrapped) for b in rows.batches]  # [T_k, H] each
        fillers = [_completion_hidden(model, b, unwrapped).sum() * 0.0 for b in rows.fillers]
    hidden, dest = torch.cat(parts), torch.cat(rows.dest)  # [T, H], [T]
    if fillers:
        hidden = hidden + torch.stack(fillers).sum()  # + 0: the values unchanged
    out = hidden.new_zeros(rows.shape[0] * rows.shape[1], hidden.size(-1)).index_copy(0, dest, hidden)
    return out.view(*rows.shape, hidden.size(-1))


def shared_logps(trainer, model, rows: SharedRows) -> Tensor:
    """``[B, C]`` fp32 per-token log-probs of the completions under ``model`` (TRL's ``_get_per_token_logps``: the
    model's logits divided by the temperature, the head in fp32 with ``cast_lm_head_to_fp32``), 0 at masked
    positions."""
    unwrapped = trainer.accelerator.unwrap_model(model)
    out = torch.zeros(rows.shape[0] * rows.shape[1], dtype=torch.float32, device=rows.dest[0].device)  # [B * C]
    for b, dest in zip(rows.batches, rows.dest, strict=True):
        with trainer.accelerator.autocast():
            hidden = _completion_hidden(model, b, unwrapped)  # [T, H]
        hidden, weight, bias = head_inputs(trainer, hidden, model)
        with torch.autocast(hidden.device.type, enabled=False):
            head = dict(bias=bias, temperature=trainer.temperature, **trainer.logit_transform.kwargs())
            logp = fused_logprobs(hidden, weight, b.targets, **head)  # [T]
        out.index_copy_(0, dest, logp.float())
    with trainer.accelerator.autocast():
        for b in rows.fillers:  # only keep the processes in step
            _completion_hidden(model, b, unwrapped)
    return out.view(rows.shape)
