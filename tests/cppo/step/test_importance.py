"""The training/inference mismatch correction (issue 37): ``cppo.step.importance_weights`` against TRL 1.16's
formula transcribed on the padded layout (``GRPOTrainer._generate_and_score_completions``), every mode and bound."""

from __future__ import annotations

import math

import pytest
import torch

from cppo.step import importance_weights, mismatch_metrics


def trl_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL's lines: ``[B, L]`` log-probs and completion mask."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return ratio if clip_min is None and clip_max is None else torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 2.0), (0.9, None), (None, None)])
def test_importance_weights_equal_trls(mode, bounds):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3]
    old = [torch.randn(n, generator=g) * 2 - 3 for n in lengths]
    sampling = [o + torch.randn(len(o), generator=g) * 0.4 for o in old]
    sampling[2][4] = float("nan")  # a token the engine could not score: no correction
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    got = importance_weights(torch.cat(old), torch.cat(sampling), cu, mode=mode, clip_min=bounds[0],
                                      clip_max=bounds[1])  # fmt: skip
    width = max(lengths)
    pad = lambda rows: torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])  # noqa: E731
    mask = pad([torch.ones(n) for n in lengths])
    want = trl_ratio(pad(old), pad(sampling), mask, mode, *bounds)  # [B, L] or [B, 1]
    if mode.startswith("sequence"):
        assert got.shape == (len(lengths),)
        torch.testing.assert_close(got, want[:, 0], rtol=1e-6, atol=0)
    else:
        torch.testing.assert_close(got, torch.cat([want[b, :n] for b, n in enumerate(lengths)]), rtol=1e-6, atol=0)
    assert torch.isfinite(got).all()


def test_mismatch_metrics_leave_nan_tokens_out():
    old, sampling = torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.5, float("nan"), -2.0])
    m = mismatch_metrics(old, sampling, torch.tensor([0.5, 1.0, 2.0]))
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(0.75)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(1.0)
    assert (m["sampling/importance_sampling_ratio/min"], m["sampling/importance_sampling_ratio/max"]) == (0.5, 2.0)


def test_bad_settings_are_refused_in_one_line():
    from cppo.config import TrainConfig

    with pytest.raises(ValueError, match="^vllm_importance_sampling_mode must be one of"):
        TrainConfig(vllm_importance_sampling_mode="token")
    with pytest.raises(ValueError, match=r"^vllm_importance_sampling_clip_min=2.0 must be <= .*clip_max=1.0$"):
        TrainConfig(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=1.0)
