"""The TRL mapping is one table (issue 39): :func:`cppo.trl.loss.loss_settings` turns a ``GRPOTrainer``'s settings
into ``(LossConfig, ScaleRule)`` through :data:`cppo.trl.loss.LOSS_TABLE`, and gives for every loss type what
CPPOTrainer handed ``fused_cppo_loss`` before the table (the expectations below were captured on that code, with the
trainer of ``test_trl_loss.py``); no other place of ``cppo/trl/`` reads a ``loss_type``."""

from __future__ import annotations

import ast
import copy
import dataclasses
import pathlib
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOConfig
from trl_tiny import make_config

from cppo.trl.loss import LOSS_TABLE, ScaleRule, loss_settings, unsupported_setting
from cppo_kernels import LossConfig
from cppo_kernels.config import LOSS_TYPES

TRL_PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "cppo" / "trl"

#: What the trainer handed the fused loss before the table, per loss type: ``(surrogate, loss_agg,
#: max_completion_length, delta)``; then, in training (2 accumulation steps of 4 per generation, 23 tokens of 40
#: items, one process) and in evaluation: the factor its loss carried over the fused one, the factor of its
#: ``policy_loss`` metric over the fused one, and the fused loss's ``entropy_coef`` for TRL's 0.05.
_PER_STEP = {"train": (0.5, 1.0, 0.05), "eval": (1.0, 1.0, 0.05)}
_PER_ITEM = {"train": (1.15, 1.15, 0.021739130885479366), "eval": (0.575, 0.575, 0.08695652354191746)}
OLD = {
    "grpo": (("clip", "seq-mean-token-mean", None, 1.3), _PER_STEP),
    "bnpo": (("clip", "token-mean", None, 1.3), _PER_STEP),
    "dr_grpo": (("clip", "seq-mean-token-sum-norm", 8, 1.3), _PER_STEP),
    "dapo": (("clip", "token-mean", None, 1.3), _PER_ITEM),
    "cispo": (("cispo", "token-mean", None, None), _PER_ITEM),
    "sapo": (("sapo", "seq-mean-token-mean", None, None), _PER_STEP),
    "luspo": (("clip", "seq-mean-token-sum", None, 1.3), _PER_STEP),
    "vespo": (("vespo", "token-mean", None, None), _PER_ITEM),
}
#: The options every loss type shared (the fixture's: temperature 0.7, clip range [0.9, 1.15], beta 0.04, ...).
SHARED = dict(
    temperature=0.7, epsilon_low=0.1, epsilon_high=0.15, dual_clip=None, beta=0.04, kl_estimator="k3",
    importance_sampling="token", compute_entropy=True, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
    vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, use_bias_correction_kl=False,
    off_policy_mask_threshold=None, top_entropy_quantile=1.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> GRPOConfig:
    return make_config(
        GRPOConfig, tmp_path_factory.mktemp("table"), temperature=0.7, epsilon=0.1, epsilon_high=0.15, beta=0.04,
        steps_per_generation=4, gradient_accumulation_steps=2, delta=1.3, entropy_coef=0.05,
        use_bias_correction_kl=False,
    )  # fmt: skip


def trainer_of(args: GRPOConfig, loss_type: str, *, training: bool = True, **overrides) -> SimpleNamespace:
    """The attributes of a ``GRPOTrainer`` that its loss reads, copied from ``args`` as TRL 1.16's constructor
    copies them (``grpo_trainer.py`` ~790-855)."""
    trainer = SimpleNamespace(
        args=args, loss_type=loss_type, temperature=args.temperature, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon, beta=args.beta,
        importance_sampling_level=args.importance_sampling_level, max_completion_length=8,
        off_policy_mask_threshold=args.off_policy_mask_threshold, top_entropy_quantile=args.top_entropy_quantile,
        entropy_coef=args.entropy_coef, use_adaptive_entropy=args.use_adaptive_entropy,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        _last_world_entropy=float("inf"), current_gradient_accumulation_steps=2,
        model=SimpleNamespace(training=training), accelerator=SimpleNamespace(num_processes=1, state=None),
        aux_loss_enabled=False, router_aux_loss_coef=0.0,
    )  # fmt: skip
    for name, value in overrides.items():
        setattr(trainer, name, value)
    return trainer


def test_the_table_covers_every_loss_type_of_the_kernels():
    assert list(LOSS_TABLE) == list(LOSS_TYPES) == list(OLD)
    for name, (surrogate, agg, rule) in LOSS_TABLE.items():
        assert (surrogate, agg) == LOSS_TYPES[name] and isinstance(rule, ScaleRule)
    with pytest.raises(ValueError, match="'accumulation' or 'items'"):
        ScaleRule("tokens")


@pytest.mark.parametrize("loss_type", OLD)
def test_each_loss_type_gives_the_config_and_scale_the_trainer_used(args, loss_type):
    (surrogate, agg, length, delta), factors = OLD[loss_type]
    epsilon_high = 1.2 if loss_type == "cispo" else 0.15  # the capture's CISPO cap
    for mode, (want_scale, want_logged, want_coef) in factors.items():
        trainer = trainer_of(args, loss_type, training=mode == "train", epsilon_high=epsilon_high)
        config, rule = loss_settings(trainer)
        want = {**SHARED, "epsilon_high": epsilon_high, "surrogate": surrogate, "loss_agg": agg}
        want.update(max_completion_length=length, delta=delta, entropy_coef=0.05)
        assert dataclasses.asdict(config) == want
        assert rule is LOSS_TABLE[loss_type][2]
        scale, logged = rule.scales(trainer, torch.tensor(23), torch.tensor(40))
        assert float(scale) == pytest.approx(want_scale, rel=1e-6)
        assert float(logged) == pytest.approx(want_logged, rel=1e-6)
        assert rule.fused_entropy_coef(trainer, config.entropy_coef, scale) == pytest.approx(want_coef, rel=1e-7)


@pytest.mark.parametrize("loss_type", OLD)
def test_the_settings_the_trainer_read_beside_the_loss_type(args, loss_type):
    """The bias-corrected KL only with beta != 0; the entropy coefficient 0 without the bonus or behind the adaptive
    gate (TRL's, from the previous window); the other options straight through."""
    options = dict(importance_sampling_level="sequence", top_entropy_quantile=0.3, off_policy_mask_threshold=0.05)
    config, _ = loss_settings(trainer_of(args, loss_type, **options))
    assert (config.importance_sampling, config.top_entropy_quantile, config.off_policy_mask_threshold) == (
        "sequence", 0.3, 0.05,
    )  # fmt: skip
    biased = copy.copy(args)
    biased.use_bias_correction_kl = True
    assert loss_settings(trainer_of(biased, loss_type))[0].use_bias_correction_kl
    assert not loss_settings(trainer_of(biased, loss_type, beta=0.0))[0].use_bias_correction_kl
    assert loss_settings(trainer_of(args, loss_type, _entropy_bonus_enabled=False))[0].entropy_coef == 0.0
    gated = dict(use_adaptive_entropy=True, _last_world_entropy=args.entropy_target + 1.0)
    assert loss_settings(trainer_of(args, loss_type, **gated))[0].entropy_coef == 0.0
    gated["_last_world_entropy"] = args.entropy_target
    assert loss_settings(trainer_of(args, loss_type, **gated))[0].entropy_coef == 0.05


def test_an_empty_micro_batch_gets_no_entropy_bonus(args):
    trainer = trainer_of(args, "dapo")
    config, rule = loss_settings(trainer)
    scale, _ = rule.scales(trainer, torch.tensor(0), torch.tensor(40))
    assert rule.fused_entropy_coef(trainer, config.entropy_coef, scale) == 0.0


def test_a_setting_outside_the_table_or_the_kernels_is_named(args):
    with pytest.raises(ValueError, match="loss_type='nope'"):
        loss_settings(trainer_of(args, "nope"))
    with pytest.raises(ValueError, match="epsilon_low must be < 1"):
        loss_settings(trainer_of(args, "dapo", epsilon_low=1.0))
    # the trainer then runs TRL's own loss, with one warning naming it (rather than failing at the first step)
    assert unsupported_setting(trainer_of(args, "nope")) == "loss_type='nope'"
    assert unsupported_setting(trainer_of(args, "dapo", epsilon_low=1.0)).startswith("epsilon_low must be < 1")
    assert unsupported_setting(trainer_of(args, "dapo")) is None


def _function_spans(tree: ast.Module, names: set[str]) -> list[range]:
    """The lines of the module-level functions and assignments named ``names``."""
    return [
        range(node.lineno, node.end_lineno + 1)
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.Assign, ast.AnnAssign))
        and (getattr(node, "name", None) in names or {_target(node)} & names)
    ]


def _target(node) -> str | None:
    target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
    return target.id if isinstance(target, ast.Name) else None


def _docstrings(tree: ast.Module) -> set[int]:
    """``id`` of every docstring constant (a module's, a class's, a function's)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _surrogate_names(tree: ast.Module) -> set[int]:
    """``id`` of every string compared with a ``.surrogate`` (a LossConfig's: cispo, sapo and vespo are surrogates
    too, by the same names)."""
    found = set()
    for node in ast.walk(tree):
        operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
        if any(isinstance(n, ast.Attribute) and n.attr == "surrogate" for n in operands):
            found |= {id(c) for n in operands for c in ast.walk(n) if isinstance(c, ast.Constant)}
    return found


def _reads_loss_type(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "loss_type") or (
        isinstance(node, ast.Name) and node.id == "loss_type"
    )


def test_only_the_table_reads_a_loss_type():
    """In ``cppo/trl/``, a loss type's name (a string, not a docstring nor a surrogate's name compared with a
    ``.surrogate``), a comparison of ``loss_type`` or a lookup by it appears only in ``loss.py``'s table and
    :func:`loss_settings`."""
    allowed = {"loss.py": {"_NORMALISERS", "LOSS_TABLE", "loss_settings"}}
    found = []
    for path in sorted(TRL_PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        spans = _function_spans(tree, allowed.get(path.name, set()))
        skipped = _docstrings(tree) | _surrogate_names(tree)
        for node in ast.walk(tree):
            named = isinstance(node, ast.Constant) and node.value in LOSS_TYPES and id(node) not in skipped
            compared = isinstance(node, ast.Compare) and any(
                _reads_loss_type(n) for n in [node.left, *node.comparators]
            )
            looked_up = isinstance(node, ast.Subscript) and _reads_loss_type(node.slice)
            if (named or compared or looked_up) and not any(node.lineno in span for span in spans):
                found.append(f"{path.name}:{node.lineno}")
    assert found == []
    table = ast.parse((TRL_PACKAGE / "loss.py").read_text(encoding="utf-8"))
    assert len(_function_spans(table, allowed["loss.py"])) == 3  # the names above still find the table


def test_the_fused_config_is_one_loss_config(args):
    """What the trainer hands ``fused_cppo_loss`` is the table's LossConfig with the entropy coefficient per fused
    aggregate: one object the kernels validate once."""
    config, rule = loss_settings(trainer_of(args, "grpo"))
    assert isinstance(config, LossConfig)
    assert config.needs_entropy and config.loss_agg == "seq-mean-token-mean"
