"""Criteria: Eq. 14 for soft attention, REINFORCE (Eq. 11-12 and Sec. 4.1's rule) for hard."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from sat_model.config import HardTrainConfig, SoftTrainConfig
from sat_model.data.vocab import END_ID, PAD_ID, START_ID
from sat_model.model.decoder import ShowAttendTell
from sat_model.model.losses import (
    HardAttentionLoss,
    SoftAttentionLoss,
    build_criterion,
    doubly_stochastic_penalty,
    token_log_likelihood,
)
from sat_model.model.outputs import ForwardOutput
from tests.factories import model_config

K, D, L = 10, 6, 4


def tiny_model(attention: str, **overrides: object) -> ShowAttendTell:
    fields: dict[str, Any] = dict(
        vocab_size=K,
        annotation_dim=D,
        num_locations=L,
        embed_dim=5,
        hidden_dim=7,
        attention_dim=5,
        attention=attention,
    )
    fields.update(overrides)
    config = model_config(**fields)
    return ShowAttendTell(config)


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    annotations = torch.randn(3, L, D, generator=torch.Generator().manual_seed(0))
    captions = torch.tensor(
        [
            [START_ID, 4, 5, END_ID, PAD_ID, PAD_ID],
            [START_ID, 6, 7, 8, 9, END_ID],
            [START_ID, 3, END_ID, PAD_ID, PAD_ID, PAD_ID],
        ]
    )
    return annotations, captions


def criterion_for(attention: str) -> SoftAttentionLoss | HardAttentionLoss:
    if attention == "soft":
        return build_criterion("soft", SoftTrainConfig(doubly_stochastic=0.7))
    return build_criterion("hard", HardTrainConfig(lambda_r=0.3, lambda_e=0.05))


# ------------------------------------------------------------------------------ soft, Eq. 14
def test_doubly_stochastic_penalty_is_zero_when_each_location_sums_to_one() -> None:
    # 4 valid steps attend to the 4 locations in turn; 2 padded steps attend anywhere
    alphas = torch.cat([torch.eye(L), torch.full((2, L), 1.0 / L)]).unsqueeze(0)  # (1, 6, L)
    alphas = torch.cat([alphas, alphas.roll(1, dims=2)])  # (2, 6, L)
    mask = torch.tensor([[True] * 4 + [False] * 2] * 2)
    torch.testing.assert_close(doubly_stochastic_penalty(alphas, mask), torch.zeros(2))


def test_doubly_stochastic_penalty_matches_a_hand_computation() -> None:
    # one step, uniform over 2 locations: Σ_i (1 - 0.5)^2 = 0.5; two steps all on location 0:
    # (1 - 2)^2 + (1 - 0)^2 = 2
    uniform = torch.tensor([[[0.5, 0.5]]])
    focused = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])
    assert doubly_stochastic_penalty(uniform, torch.tensor([[True]])).item() == pytest.approx(0.5)
    assert doubly_stochastic_penalty(focused, torch.tensor([[True, True]])).item() == 2.0


def test_soft_loss_with_uniform_logits_is_tokens_times_log_k_plus_penalty() -> None:
    _, captions = padded_batch()
    B, T = captions.shape[0], captions.shape[1] - 1
    alphas = torch.full((B, T, L), 1.0 / L)
    output = ForwardOutput(logits=torch.zeros(B, T, K), alphas=alphas, betas=torch.ones(B, T))
    result = SoftAttentionLoss(doubly_stochastic=2.0)(output, captions)
    tokens = [3, 5, 2]  # words + <end> per caption
    # each caption: Σ_i (1 - steps/L)^2 over L locations
    penalty = [L * (1 - n / L) ** 2 for n in tokens]
    expected = sum(n * math.log(K) + 2.0 * p for n, p in zip(tokens, penalty, strict=True)) / 3
    assert result.loss.item() == pytest.approx(expected, rel=1e-5)
    assert result.nll.item() == pytest.approx(math.log(K), rel=1e-5)


def test_token_log_likelihood_is_zero_on_padded_steps_even_when_logits_are_not_finite() -> None:
    logits = torch.zeros(1, 3, K)
    logits[0, 2] = float("nan")
    mask = torch.tensor([[True, True, False]])
    out = token_log_likelihood(logits, torch.tensor([[4, END_ID, PAD_ID]]), mask)
    torch.testing.assert_close(out, torch.tensor([[-math.log(K), -math.log(K), 0.0]]))


# ---------------------------------------------------------------------- padding invariance
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_loss_does_not_change_when_padding_columns_are_appended(attention: str) -> None:
    model, criterion = tiny_model(attention), criterion_for(attention)
    criterion.eval()  # keep the baseline fixed between the two calls
    annotations, captions = padded_batch()
    longer = F.pad(captions, (0, 3), value=PAD_ID)
    torch.manual_seed(0)
    short_loss = criterion(model(annotations, captions), captions).loss
    torch.manual_seed(0)  # the same sampled paths: extra steps come after the real ones
    long_loss = criterion(model(annotations, longer), longer).loss
    torch.testing.assert_close(long_loss, short_loss)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_loss_does_not_change_when_padded_steps_change(attention: str) -> None:
    torch.manual_seed(0)
    model, criterion = tiny_model(attention), criterion_for(attention)
    criterion.eval()
    annotations, captions = padded_batch()
    out = model(annotations, captions)
    pad = (captions[:, 1:] == PAD_ID).unsqueeze(-1)  # (B, T, 1)

    def scramble(x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        noise = torch.randn_like(x) * 100
        noise[..., 0] = float("inf") if x.dim() == 3 else noise[..., 0]
        return torch.where(pad if x.dim() == 3 else pad[..., 0], noise, x)

    scrambled = ForwardOutput(
        logits=scramble(out.logits),  # type: ignore[arg-type]
        alphas=scramble(out.alphas),  # type: ignore[arg-type]
        betas=out.betas,
        location_log_probs=scramble(out.location_log_probs),
        entropy=scramble(out.entropy),
        sampled=out.sampled,
    )
    torch.testing.assert_close(criterion(scrambled, captions).loss, criterion(out, captions).loss)


# ------------------------------------------------------------------------ hard, Sec. 4.1
def synthetic_hard_output(
    reward_per_token: list[float], steps: int, sampled: list[bool]
) -> tuple[ForwardOutput, torch.Tensor]:
    """Outputs whose per-token log-likelihood is exactly ``reward_per_token[b]``."""
    B = len(reward_per_token)
    captions = torch.full((B, steps + 1), 4)
    captions[:, 0], captions[:, -1] = START_ID, END_ID
    # logits: target token 4 (and <end>) get log-prob r, via log-softmax of a 2-way split
    logits = torch.full((B, steps, K), -1e9)
    for b, r in enumerate(reward_per_token):
        p = math.exp(r)
        target = torch.tensor([4] * (steps - 1) + [END_ID])
        logits[b, torch.arange(steps), target] = math.log(p)
        logits[b, :, 9] = math.log(1 - p)
    output = ForwardOutput(
        logits=logits,
        alphas=torch.full((B, steps, L), 1 / L),
        betas=torch.ones(B, steps),
        location_log_probs=torch.full((B, steps), -math.log(L), requires_grad=True),
        entropy=torch.full((B, steps), math.log(L)),
        sampled=torch.tensor(sampled),
    )
    return output, captions


def test_baseline_follows_its_moving_average_rule() -> None:
    criterion = HardAttentionLoss(lambda_r=0.1, lambda_e=0.0, baseline_decay=0.9)
    assert criterion.baseline.item() == 0.0  # b_0 = 0
    criterion(*synthetic_hard_output([-2.0, -4.0], steps=3, sampled=[True, True]))
    # b_1 = 0.9 * 0 + 0.1 * mean(-2, -4)
    assert criterion.baseline.item() == pytest.approx(-0.3, rel=1e-5)
    criterion(*synthetic_hard_output([-1.0, -5.0], steps=2, sampled=[True, False]))
    # b_2 = 0.9 * (-0.3) + 0.1 * (-1): only the caption that sampled s̃ counts
    assert criterion.baseline.item() == pytest.approx(-0.37, rel=1e-5)
    criterion(*synthetic_hard_output([-1.0], steps=2, sampled=[False]))
    assert criterion.baseline.item() == pytest.approx(-0.37, rel=1e-5)  # nothing sampled
    criterion.eval()
    criterion(*synthetic_hard_output([-9.0], steps=2, sampled=[True]))
    assert criterion.baseline.item() == pytest.approx(-0.37, rel=1e-5)  # eval never updates
    assert "baseline" in criterion.state_dict()


def test_reinforce_term_weights_path_log_probs_by_reward_minus_baseline() -> None:
    criterion = HardAttentionLoss(lambda_r=0.5, lambda_e=0.0, baseline_decay=0.9)
    criterion.baseline.fill_(-3.0)
    output, captions = synthetic_hard_output([-1.0, -2.0, -5.0], steps=4, sampled=[1, 1, 0])
    criterion(output, captions).loss.backward()
    # loss = -(1/B) Σ_b λ_r (r_b - b) Σ_t log p(s̃_t): ∂/∂ log p(s̃_t) = -λ_r (r_b - b) / B,
    # zero for the caption whose α replaced s̃
    expected = torch.tensor([-0.5 * 2.0 / 3, -0.5 * 1.0 / 3, 0.0]).unsqueeze(1).expand(3, 4)
    torch.testing.assert_close(output.location_log_probs.grad, expected)  # type: ignore[union-attr]


def test_entropy_bonus_lowers_the_loss() -> None:
    output, captions = synthetic_hard_output([-1.0, -2.0], steps=3, sampled=[False, False])
    plain = HardAttentionLoss(lambda_r=0.1, lambda_e=0.0, baseline_decay=0.9)(output, captions)
    bonus = HardAttentionLoss(lambda_r=0.1, lambda_e=0.2, baseline_decay=0.9)(output, captions)
    # - λ_e Σ_t H per caption: 0.2 * 3 * log L
    assert plain.loss.item() - bonus.loss.item() == pytest.approx(0.2 * 3 * math.log(L), rel=1e-5)


def exact_gradient(model: ShowAttendTell, a: torch.Tensor, caption: torch.Tensor) -> torch.Tensor:
    """∂L_s/∂W with L_s = Σ_s p(s|a) log p(y|s,a) over all L^T attention paths (Eq. 10-11)."""
    T = caption.shape[1] - 1
    Lm = model.config.num_locations
    paths = torch.tensor(list(itertools.product(range(Lm), repeat=T)))  # (L^T, T)
    n = paths.shape[0]
    out = model(a.expand(n, -1, -1), caption.expand(n, -1), mode="train", locations=paths)
    targets = caption[:, 1:].expand(n, -1)
    log_lik = token_log_likelihood(out.logits, targets, targets != PAD_ID).sum(1)  # (L^T,)
    path_prob = out.location_log_probs.sum(1).exp()  # type: ignore[union-attr]
    torch.testing.assert_close(path_prob.sum(), torch.tensor(1.0))  # the paths are exhaustive
    L_s = (path_prob * log_lik).sum()
    return _flat(torch.autograd.grad(L_s, list(model.parameters())))


def mc_gradients(
    model: ShowAttendTell, a: torch.Tensor, caption: torch.Tensor, lambda_r: float, chunks: int
) -> torch.Tensor:
    """(chunks, P): each row the mean REINFORCE estimate of ∂L_s/∂W over 2000 samples."""
    criterion = HardAttentionLoss(lambda_r=lambda_r, lambda_e=0.0, baseline_decay=0.9, reward="sum")
    criterion.eval()  # baseline stays at 0
    n = 2000
    rows = []
    for _ in range(chunks):
        loss = criterion(model(a.expand(n, -1, -1), caption.expand(n, -1)), caption.expand(n, -1))
        rows.append(-_flat(torch.autograd.grad(loss.loss, list(model.parameters()))))
    return torch.stack(rows)


def _flat(grads: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def test_reinforce_estimator_matches_the_exact_gradient_of_the_lower_bound() -> None:
    torch.manual_seed(0)
    model = tiny_model(
        "hard",
        vocab_size=5,
        annotation_dim=3,
        num_locations=2,
        embed_dim=3,
        hidden_dim=4,
        attention_dim=3,
        semi_sampling_p=0.0,
    )
    # sharpen attention and let the context drive the words, so that paths differ both in
    # probability and in likelihood and the score-function term matters
    with torch.no_grad():
        model.attention.score.weight.mul_(4.0)
        model.context_out.weight.mul_(6.0)
    a = 2 * torch.randn(1, 2, 3)
    caption = torch.tensor([[START_ID, 3, 4, END_ID]])  # T = 3: 2^3 = 8 paths
    exact = exact_gradient(model, a, caption)
    samples = mc_gradients(model, a, caption, lambda_r=1.0, chunks=30)
    z = _z_scores(samples, exact)
    assert z.max() < 5.5, f"max |z| = {z.max():.1f} over {z.numel()} parameters"
    assert (samples.mean(0) - exact).norm() < 0.08 * exact.norm()
    # the test has power: without the score-function term the estimate is clearly biased
    pathwise = mc_gradients(model, a, caption, lambda_r=0.0, chunks=10)
    assert _z_scores(pathwise, exact).max() > 10
    assert (pathwise.mean(0) - exact).norm() > 0.12 * exact.norm()


def _z_scores(samples: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|mean - exact| in standard errors of the mean, per parameter."""
    se = samples.std(0) / math.sqrt(samples.shape[0])
    return (samples.mean(0) - exact).abs() / (se + 1e-7)


# -------------------------------------------------------------------------------- factory
def test_build_criterion_reads_the_train_sections() -> None:
    soft = build_criterion("soft", SoftTrainConfig(doubly_stochastic=0.25))
    hard = build_criterion("hard", HardTrainConfig(lambda_r=0.2, lambda_e=0.01))
    assert isinstance(soft, SoftAttentionLoss) and soft.doubly_stochastic == 0.25
    assert isinstance(hard, HardAttentionLoss) and (hard.lambda_r, hard.lambda_e) == (0.2, 0.01)


def test_build_criterion_rejects_mismatched_sections_and_names() -> None:
    with pytest.raises(TypeError, match="HardTrainConfig"):
        build_criterion("hard", SoftTrainConfig())
    with pytest.raises(ValueError, match="'glimpse'"):
        build_criterion("glimpse", SoftTrainConfig())
