"""What pruning changes: the old-policy, reference and policy passes see the kept completions only (counted on the
backbones' forwards), the kept ones are those with the largest |advantage| of TRL's own advantages, padded to the
longest kept one, and num_items_in_batch is recounted over them; allocation draws 1/(1 - P) times more prompts."""

from __future__ import annotations

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer
from trl_tiny import PassCounter, digit_reward, make_config, tiny_dataset

from cppo.trl import CPPOConfig, CPPOTrainer

#: One generation per two steps (num_iterations=2: TRL then runs the old-policy pass), beta > 0 (the reference pass).
OPTIONS = dict(per_device_train_batch_size=16, beta=0.04, num_iterations=2, max_steps=4)


def build(cls, config_cls, model: str, out, **options):
    args = make_config(config_cls, out, **{**OPTIONS, **options})
    return cls(model=model, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset())


def train_counted(trainer) -> tuple[PassCounter, list[dict]]:
    """Trains, counting every training-pass forward of the policy and the reference model, and recording each
    generation's batches before and after pruning."""
    counter, batches = PassCounter(), []
    if isinstance(trainer, CPPOTrainer):
        original = trainer._kept_rows

        def kept_rows(advantages):
            kept, placeholder = original(advantages)
            batches.append({"advantages": advantages.clone(), "kept": kept.clone()})
            return kept, placeholder

        trainer._kept_rows = kept_rows
    with counter.hook("policy", trainer.model), counter.hook("reference", trainer.ref_model):
        trainer.train()
    return counter, batches


def test_the_passes_see_only_the_kept_completions(tiny_model, tmp_path):
    stock = build(GRPOTrainer, GRPOConfig, tiny_model, tmp_path / "stock")
    stock_passes, _ = train_counted(stock)  # built then trained in turn: building a trainer seeds the global RNG
    # padded rows, as stock TRL's (prefix sharing packs a pass into one row: test_trl_prefix_sharing.py)
    cppo = build(CPPOTrainer, CPPOConfig, tiny_model, tmp_path / "cppo", pruning_rate=0.75, prefix_sharing=False)
    cppo_passes, batches = train_counted(cppo)
    generations, kept = 2, 16 - int(16 * 0.75)
    # stock: the old-policy and reference passes over all 16 completions of each generation, then 4 policy passes
    assert stock_passes.rows("policy", grad=False) == [16] * generations
    assert stock_passes.rows("reference", grad=False) == [16] * generations
    assert stock_passes.rows("policy", grad=True) == [16] * 4
    # CPPO: the same passes over the 4 kept completions only
    assert cppo_passes.rows("policy", grad=False) == [kept] * generations
    assert cppo_passes.rows("reference", grad=False) == [kept] * generations
    assert cppo_passes.rows("policy", grad=True) == [kept] * 4
    assert len(batches) == generations and all(len(b["kept"]) == kept for b in batches)
    # the positions each CPPO pass processes are what its metrics say, and at most a quarter of the full batch's
    logged = [h for h in cppo.state.log_history if "cppo/pass_tokens" in h]
    pass_tokens = [h["cppo/pass_tokens"] for h in logged]
    full = [h["cppo/pass_tokens"] + h["cppo/pass_tokens_saved"] for h in logged]
    assert [p.positions for p in cppo_passes.passes["reference"]] == pass_tokens
    assert all(p <= f * (1 - 0.75) + 1e-9 for p, f in zip(pass_tokens, full, strict=True)), (pass_tokens, full)
    # the first generation is the same in both runs (same seed and weights): the full batch is stock's
    assert full[0] == stock_passes.passes["reference"][0].positions
    assert [h["cppo/kept_fraction"] for h in logged] == [0.25, 0.25]


def test_the_kept_are_the_largest_advantages(tiny_model, tmp_path):
    trainer = build(CPPOTrainer, CPPOConfig, tiny_model, tmp_path, pruning_rate=0.5, max_steps=2)
    _, batches = train_counted(trainer)
    magnitude, kept = batches[0]["advantages"].abs(), batches[0]["kept"]
    pruned = torch.ones_like(magnitude, dtype=torch.bool)
    pruned[kept] = False
    assert len(kept) == 8 and magnitude[kept].min() >= magnitude[pruned].max()
    assert torch.equal(kept, kept.sort().values)


def test_the_kept_rows_are_unpadded_and_recounted(tiny_model, tmp_path):
    """The batch a step trains on: kept rows only, prompt and completion widths those of the longest kept one,
    num_items_in_batch their completion tokens."""
    trainer = build(CPPOTrainer, CPPOConfig, tiny_model, tmp_path, pruning_rate=0.5, max_steps=2)
    trainer.model.train()
    inputs = [{"prompt": row["prompt"]} for row in tiny_dataset(4) for _ in range(4)]
    batch = trainer._generate_and_score_completions(inputs)
    assert batch["completion_ids"].size(0) == 8 and batch["prompt_ids"].size(0) == 8
    assert batch["completion_mask"][:, -1].any() and batch["prompt_mask"][:, 0].any()  # no column all padding
    assert batch["num_items_in_batch"].item() == batch["completion_mask"].sum().item()
    assert batch["ref_per_token_logps"].shape == batch["completion_ids"].shape


@pytest.mark.parametrize("scope", ["group", "global"])
def test_every_scope_keeps_its_count(tiny_model, tmp_path, scope):
    trainer = build(CPPOTrainer, CPPOConfig, tiny_model, tmp_path, pruning_rate=0.5, max_steps=2, selection_scope=scope)
    _, batches = train_counted(trainer)
    kept, groups = batches[0]["kept"], batches[0]["kept"] // 4
    assert len(kept) == 8
    if scope == "group":  # 2 of each question's 4
        assert torch.bincount(groups, minlength=4).tolist() == [2, 2, 2, 2]


def test_allocation_draws_more_prompts_and_trains_as_many_as_grpo(tiny_model, tmp_path):
    """P = 0.5 with allocation: each generation draws 8 prompts (32 completions) instead of 4, keeps 16 (what
    GRPO trains), and an epoch of 64 prompts takes half the optimizer steps."""
    grpo = build(CPPOTrainer, CPPOConfig, tiny_model, tmp_path / "grpo")
    trainer = build(
        CPPOTrainer, CPPOConfig, tiny_model, tmp_path / "alloc", pruning_rate=0.5, allocation=True, prefix_sharing=False
    )  # padded rows, counted as such
    assert trainer.local_generation_size == 32 and grpo.local_generation_size == 16
    assert len(trainer.get_train_dataloader()) * 2 == len(grpo.get_train_dataloader())
    passes, batches = train_counted(trainer)
    assert [len(b["advantages"]) for b in batches] == [32, 32]
    assert passes.rows("policy", grad=True) == [16] * 4
