"""The ``vllm`` engine: a colocated vLLM engine on the GPU that reloads the policy's weights after each optimizer
step, sent in the compute dtype. vLLM is imported only when this engine is built, never with the package."""

from __future__ import annotations

import torch

from .base import EngineSettings, Rollout, RolloutEngine, cut_after_eos, encode_prompts, eos_ids, register_engine


class VLLMEngine(RolloutEngine):
    """Colocated vLLM engine (GPU). ``sync_weights()`` loads the policy's current weights into the engine; greedy
    evaluation decodes with transformers on the policy (the default :meth:`RolloutEngine.for_evaluation`)."""

    requires = {"vllm": "pip install vllm (GPU only)"}

    #: Share of the GPU's memory the colocated engine may take (the policy's training shares the rest).
    gpu_memory_utilization = 0.3

    def __init__(self, model, tokenizer, settings: EngineSettings) -> None:
        try:
            import vllm
        except ImportError as e:
            raise ImportError(
                "rollout_backend='vllm' needs vLLM (GPU only): pip install vllm, or set rollout_backend=hf"
            ) from e
        super().__init__(model, tokenizer, settings)
        self.vllm, self.eos_ids = vllm, eos_ids(tokenizer, model)
        self.dtype = settings.compute_dtype or model.dtype  # the engine's weights: the compute dtype
        self.llm = vllm.LLM(
            model=settings.model_name,
            dtype=str(self.dtype).removeprefix("torch."),
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=settings.max_prompt_length + settings.max_completion_length,
            enable_prefix_caching=True,
        )

    def generate(self, prompts: list[str], num_per_prompt: int, *, greedy: bool = False) -> Rollout:
        """vLLM's sampling, seeded from torch's global RNG (seed it first); greedy at temperature 0."""
        s = self.settings
        ids = encode_prompts(self.tokenizer, prompts, s.max_prompt_length)
        params = self.vllm.SamplingParams(
            n=num_per_prompt,
            temperature=0.0 if greedy else s.temperature,
            top_p=1.0 if greedy else s.top_p,
            max_tokens=s.max_completion_length,
            seed=int(torch.randint(0, 2**31 - 1, ()).item()),
        )
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        prompt_ids, completions = [], []
        for p, out in zip(ids, outputs):
            for o in out.outputs:
                prompt_ids.append(p)
                completions.append(cut_after_eos(list(o.token_ids), self.eos_ids, s.max_completion_length))
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        return Rollout(prompt_ids, completions, texts)

    def sync_weights(self) -> None:
        """Loads the policy's current weights, cast to the compute dtype, and drops the engine's prefix cache."""
        engine_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        engine_model.load_weights((k, v.to(self.dtype)) for k, v in self.model.state_dict().items())
        self.llm.reset_prefix_cache()


register_engine("vllm", VLLMEngine)
