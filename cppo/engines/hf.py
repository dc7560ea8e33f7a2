"""The ``hf`` engine: transformers ``generate`` on the policy itself (CPU and GPU, batched, left-padded), in the
compute dtype under ``torch.autocast``; under FSDP2 every rank keeps stepping until all are done (``synced_gpus``).
With ``prefill_once`` (the default) a prompt's G completions share one prefill of it (:mod:`.prefill`). Generating
ahead of training (``EngineSettings.own_weights``) it samples from a copy of the policy, synced by
:meth:`HFEngine.sync_weights`, and reports each sampled token's log-prob under that copy (:func:`sampled_logprobs`)."""

from __future__ import annotations

import copy
import functools

import torch

from ..distributed import autocast
from .base import EngineSettings, Rollout, RolloutEngine, cut_after_eos, encode_prompts, eos_ids, register_engine
from .prefill import generate_prefilled_once, prefill_once_applies, prefill_positions
from .resume import generate_with_stops


class HFEngine(RolloutEngine):
    """Batched sampling with ``model.generate`` (temperature / top-p, no top-k), stopping at EOS."""

    supports_sharded = True  # FSDP2's blocks gather their shards in every forward: the ranks stay in step
    supports_lora = True  # generate runs the policy itself, adapters included
    supports_stopping = True  # generate resumed from the checkpoint's cache with the surviving rows (.resume)
    supports_greedy = True  # evaluation decodes with generate on the policy too (for_evaluation: itself)
    supports_overlap = True  # with settings.own_weights: a copy of the policy, synced when the trainer says

    def __init__(self, model, tokenizer, settings: EngineSettings) -> None:
        super().__init__(model, tokenizer, settings)
        self.eos_ids = eos_ids(tokenizer, model)
        self.policy = model
        if settings.own_weights:  # generating ahead: sampling never reads weights the training step is changing
            self.model = copy.deepcopy(model).requires_grad_(False).eval()

    @torch.no_grad()
    def generate(self, prompts: list[str], num_per_prompt: int, *, greedy: bool = False, stopper=None) -> Rollout:
        """``num_per_prompt`` completions of each prompt; sampling draws from torch's global RNG (seed it first).
        ``stopper``: stop rows at a checkpoint and decode only the others on (:mod:`.resume`)."""
        s = self.settings  # a stopper never comes with s.sharded: the config refuses rollout_stop under fsdp2
        encoded = encode_prompts(self.tokenizer, prompts, s.max_prompt_length)
        prompt_ids = [p for p in encoded for _ in range(num_per_prompt)]
        if not prompt_ids:
            return Rollout([], [], [])
        device = self.model.device
        width = max(len(p) for p in prompt_ids)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)  # [N, Lp]
        attention_mask = torch.zeros_like(input_ids)  # [N, Lp]
        for i, p in enumerate(prompt_ids):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention_mask[i, width - len(p) :] = 1
        was_training = self.model.training
        self.model.eval()
        config = self._generation_config(greedy=greedy)
        # one prefill per prompt when it has several completions and the model's cache can be shared (decided by one
        # probe forward per model, which every rank runs alike, as it decides alike: FSDP2 stays in step)
        shared = s.prefill_once and num_per_prompt > 1 and prefill_once_applies(self.model, config)
        generate = functools.partial(generate_prefilled_once, self.model) if shared else self.model.generate
        stopped = None
        with autocast(device, s.compute_dtype):
            if stopper is None:
                out = generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    generation_config=config,
                    synced_gpus=s.sharded,
                )  # [N, Lp + Lc]
            else:
                out, stopped = generate_with_stops(
                    self.model, generate, input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                    generation_config=config, stopper=stopper, eos=self.eos_ids, pad_id=pad,
                )  # fmt: skip
        self.model.train(was_training)
        completions = [
            cut_after_eos(row, self.eos_ids, stopper.at if stopped and stopped[i] else s.max_completion_length)
            for i, row in enumerate(out[:, width:].tolist())
        ]
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        prefill = prefill_positions(prompt_ids, shared=shared)
        logprobs = None
        if s.own_weights and not greedy:  # the behaviour policy's log-probs, for the stale rollouts' correction
            logprobs = sampled_logprobs(self.model, prompt_ids, completions, temperature=s.temperature,
                                        compute_dtype=s.compute_dtype)  # fmt: skip
        return Rollout(prompt_ids, completions, texts, sampling_logprobs=logprobs, prefill_tokens=prefill,
                       stopped=stopped)  # fmt: skip

    def _generation_config(self, *, greedy: bool):
        from transformers import GenerationConfig

        return GenerationConfig(
            max_new_tokens=self.settings.max_completion_length,
            do_sample=not greedy,
            temperature=None if greedy else self.settings.temperature,
            top_p=None if greedy else self.settings.top_p,
            top_k=None if greedy else 0,  # sampling: 0 disables top-k (None would fall back to the default 50)
            repetition_penalty=1.0,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.tokenizer.pad_token_id,
            use_cache=True,
        )

    def sync_weights(self) -> None:
        """With ``own_weights``: the policy's current weights copied into the engine's copy (LoRA adapters included);
        otherwise nothing to do: generate runs the policy itself."""
        if self.model is not self.policy:
            with torch.no_grad():
                self.model.load_state_dict(self.policy.state_dict())


@torch.no_grad()
def sampled_logprobs(model, prompt_ids: list[list[int]], completions: list[list[int]], *, temperature: float,
                     compute_dtype: torch.dtype | None, rows: int = 16) -> list[list[float]]:  # fmt: skip
    """Each completion token's log-prob under ``model`` after ``temperature`` and the model's own logit scale and cap
    (as vLLM's processed log-probs; top-p's truncation not applied): one teacher-forced forward of the decoder per
    ``rows`` completions (right-padded), its final hidden states at the completions' positions through
    ``fused_logprobs`` (the LM head in chunks: no ``[T, V]`` logits)."""
    from cppo_kernels import fused_logprobs

    from ..step import decoder, lm_head, logit_transform

    device, transform = model.device, logit_transform(model)
    weight, bias = lm_head(model)
    out: list[list[float]] = []
    for lo in range(0, len(prompt_ids), rows):
        batch = list(zip(prompt_ids[lo : lo + rows], completions[lo : lo + rows]))
        width = max(len(p) + len(c) for p, c in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, c) in enumerate(batch):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            mask[i, : len(p) + len(c)] = 1
        with autocast(device, compute_dtype):
            states = decoder(model)(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        hidden = torch.cat([states[i, len(p) - 1 : len(p) + len(c) - 1] for i, (p, c) in enumerate(batch)])  # [T, H]
        targets = torch.tensor([t for _, c in batch for t in c], device=device)
        dtype = hidden.dtype
        values = fused_logprobs(hidden, weight.to(dtype), targets, bias=None if bias is None else bias.to(dtype),
                                temperature=temperature, **transform.kwargs())  # fmt: skip
        out += [v.tolist() for v in values.float().split([len(c) for _, c in batch])]
    return out


register_engine("hf", HFEngine, auto_priority=0)  # auto: runs every model, after any engine that runs it
