"""Rollouts: G completions per prompt, as token ids cut after the first EOS (or at max_completion_length).

``HFRollout`` runs ``transformers`` ``generate`` (CPU and GPU, batched, left-padded). ``VLLMRollout`` runs a
colocated vLLM engine on the GPU and reloads the policy's weights after each optimizer step; vLLM is imported
only when that backend is asked for. Both generate in the run's compute dtype (``compute_dtype``): the fp32 master
weights are cast under ``torch.autocast`` (transformers) or sent to the engine in that dtype (vLLM).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from .models import autocast


@dataclass
class Rollout:
    """N = num_prompts * G completions, prompt after prompt (completion i belongs to prompt i // G)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]

    @property
    def lengths(self) -> list[int]:
        return [len(c) for c in self.completion_ids]


def cut_after_eos(ids: list[int], eos_ids: set[int], max_length: int) -> list[int]:
    """The completion mask as a cut: tokens up to and including the first EOS, at most ``max_length`` tokens."""
    ids = ids[:max_length]
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    return ids


def encode_prompts(tokenizer, prompts: list[str], max_prompt_length: int) -> list[list[int]]:
    """Token ids of each prompt, truncated on the left to ``max_prompt_length``."""
    return [p[-max_prompt_length:] for p in tokenizer(prompts, add_special_tokens=False)["input_ids"]]


def _eos_ids(tokenizer, model) -> set[int]:
    eos = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            eos.add(source)
        elif source is not None:
            eos.update(source)
    if not eos:
        raise ValueError("the tokenizer has no eos_token: completions could never end")
    return eos


class HFRollout:
    """Batched sampling with ``model.generate`` (temperature / top-p, no top-k), stopping at EOS."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_prompt_length: int,
        max_completion_length: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        synced_gpus: bool = False,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.compute_dtype = compute_dtype  # None: the weights' own dtype
        self.max_prompt_length, self.max_completion_length = max_prompt_length, max_completion_length
        self.temperature, self.top_p = temperature, top_p
        self.synced_gpus = synced_gpus  # FSDP2: keep stepping until every rank is done (its blocks gather in step)
        self.eos_ids = _eos_ids(tokenizer, model)

    @torch.no_grad()
    def generate(self, prompts: list[str], num_per_prompt: int, *, greedy: bool = False) -> Rollout:
        """``num_per_prompt`` completions of each prompt; sampling draws from torch's global RNG (seed it first)."""
        from transformers import GenerationConfig

        prompt_ids = [
            p for p in encode_prompts(self.tokenizer, prompts, self.max_prompt_length) for _ in range(num_per_prompt)
        ]
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
        gen = GenerationConfig(
            max_new_tokens=self.max_completion_length,
            do_sample=not greedy,
            temperature=None if greedy else self.temperature,
            top_p=None if greedy else self.top_p,
            top_k=None if greedy else 0,  # sampling: 0 disables top-k (None would fall back to the default 50)
            repetition_penalty=1.0,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=pad,
            use_cache=True,
        )
        was_training = self.model.training
        self.model.eval()
        with autocast(device, self.compute_dtype):
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=gen,
                synced_gpus=self.synced_gpus,
            )  # [N, Lp + Lc]
        self.model.train(was_training)
        completions = [cut_after_eos(row, self.eos_ids, self.max_completion_length) for row in out[:, width:].tolist()]
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        return Rollout(prompt_ids, completions, texts)

    def sync_weights(self) -> None:
        """Nothing to do: generate runs the policy itself."""


class VLLMRollout:
    """Colocated vLLM engine (GPU). ``sync_weights()`` loads the policy's current weights into the engine."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        model_name: str,
        max_prompt_length: int,
        max_completion_length: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        try:
            import vllm
        except ImportError as e:
            raise ImportError(
                "rollout_backend='vllm' needs vLLM (GPU only): pip install vllm, or set rollout_backend=hf"
            ) from e
        self.vllm, self.model, self.tokenizer = vllm, model, tokenizer
        self.max_prompt_length, self.max_completion_length = max_prompt_length, max_completion_length
        self.temperature, self.top_p = temperature, top_p
        self.eos_ids = _eos_ids(tokenizer, model)
        self.compute_dtype = compute_dtype or model.dtype  # the engine's weights: the compute dtype
        self.llm = vllm.LLM(
            model=model_name,
            dtype=str(self.compute_dtype).removeprefix("torch."),
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_prompt_length + max_completion_length,
            enable_prefix_caching=True,
        )

    def generate(self, prompts: list[str], num_per_prompt: int, *, greedy: bool = False) -> Rollout:
        ids = encode_prompts(self.tokenizer, prompts, self.max_prompt_length)
        params = self.vllm.SamplingParams(
            n=num_per_prompt,
            temperature=0.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p,
            max_tokens=self.max_completion_length,
            seed=int(torch.randint(0, 2**31 - 1, ()).item()),
        )
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        prompt_ids, completions = [], []
        for p, out in zip(ids, outputs):
            for o in out.outputs:
                prompt_ids.append(p)
                completions.append(cut_after_eos(list(o.token_ids), self.eos_ids, self.max_completion_length))
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        return Rollout(prompt_ids, completions, texts)

    def sync_weights(self) -> None:
        engine_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        engine_model.load_weights((k, v.to(self.compute_dtype)) for k, v in self.model.state_dict().items())
        self.llm.reset_prefix_cache()


def make_rollout(backend: str, model, tokenizer, *, model_name: str, **options):
    """``hf`` or ``vllm``; ``auto`` picks vLLM on CUDA when it is installed, generate otherwise."""
    if backend == "auto":
        use_vllm = model.device.type == "cuda" and importlib.util.find_spec("vllm") is not None
        backend = "vllm" if use_vllm and not model_name.startswith("tiny-") else "hf"
    if backend == "vllm":
        return VLLMRollout(model, tokenizer, model_name=model_name, **options)
    return HFRollout(model, tokenizer, **options)
