"""Training criteria: soft attention (Eq. 14) and hard attention (REINFORCE, Sec. 4.1).

Dimensions (docs/METHOD.md): ``B`` batch, ``T`` caption steps, ``L`` annotation locations, ``K``
vocabulary size. Targets are ``captions[:, 1:]`` (B, T); the step mask is ``targets != <pad>``.

Reductions, chosen once and used by both criteria so that the loss does not depend on padding:
- the log-likelihood log p(y|a) is summed over a caption's (unpadded) tokens and averaged over
  captions, as in the authors' code (``(cost * mask).sum(0).mean()``);
- the doubly stochastic penalty follows the paper's text, Σ_i (1 - Σ_t α_ti)^2 per caption with
  padded steps left out of Σ_t, averaged over captions. The authors' code instead sums
  (1 - Σ_t α_ti)^2 over the batch and averages over locations, and keeps padded steps in Σ_t,
  which makes λ depend on the batch size and on padding;
- the hard criterion's REINFORCE reward is log p(y|s̃,a) averaged over the caption's steps
  (authors' code), its entropy bonus H is summed over steps per caption like the likelihood.
``nll`` (reported) is the mean negative log-likelihood per unpadded token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sat_model.config import HardTrainConfig, SoftTrainConfig
from sat_model.data.vocab import PAD_ID
from sat_model.model.outputs import ForwardOutput

__all__ = [
    "REWARDS",
    "HardAttentionLoss",
    "LossOutput",
    "SelfCriticalLoss",
    "SoftAttentionLoss",
    "build_criterion",
    "doubly_stochastic_penalty",
    "token_log_likelihood",
]

REWARDS = ("mean", "sum")


@dataclass(frozen=True)
class LossOutput:
    loss: Tensor  # scalar to back-propagate
    nll: Tensor  # scalar, detached: mean NLL per unpadded token
    metrics: dict[str, float]


def token_log_likelihood(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """log p(y_t | a, y_<t) per step, zero on padded steps: (B, T, K), (B, T) -> (B, T)."""
    B, T, K = logits.shape
    nll = F.cross_entropy(logits.reshape(B * T, K), targets.reshape(B * T), reduction="none")
    return _masked(-nll.view(B, T), mask)  # (B, T)


def doubly_stochastic_penalty(alphas: Tensor, mask: Tensor) -> Tensor:
    """Σ_i (1 - Σ_t α_ti)^2 per caption (Eq. 14), padded steps out of Σ_t: (B, T, L) -> (B,)."""
    coverage = _masked(alphas, mask.unsqueeze(-1)).sum(dim=1)  # (B, L)
    return ((1.0 - coverage) ** 2).sum(dim=-1)  # (B,)


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    # where, not a product: a non-finite value on a padded step must not leak in as 0 * inf
    return torch.where(mask, values, values.new_zeros(()))


def _targets_and_mask(captions: Tensor, output: ForwardOutput) -> tuple[Tensor, Tensor]:
    targets = captions[:, 1:]  # (B, T)
    if targets.shape != output.logits.shape[:2]:
        raise ValueError(
            f"captions {tuple(captions.shape)} do not match logits {tuple(output.logits.shape)}: "
            "expected captions of shape (B, T+1)"
        )
    mask = targets != PAD_ID  # (B, T)
    return targets, mask


def _metrics(**values: Tensor) -> dict[str, float]:
    # one device sync for all metrics instead of one .item() per value
    floats = torch.stack([v.detach().float() for v in values.values()]).tolist()
    return dict(zip(values, floats, strict=True))


class SoftAttentionLoss(nn.Module):
    """L_d = -log p(y|a) + λ Σ_i (1 - Σ_t α_ti)^2 (Eq. 14)."""

    def __init__(self, doubly_stochastic: float) -> None:
        super().__init__()
        if doubly_stochastic < 0:
            raise ValueError(f"doubly_stochastic must be >= 0, got {doubly_stochastic}")
        self.doubly_stochastic = doubly_stochastic

    def forward(self, output: ForwardOutput, captions: Tensor) -> LossOutput:
        targets, mask = _targets_and_mask(captions, output)
        log_lik = token_log_likelihood(output.logits, targets, mask)  # (B, T)
        penalty = doubly_stochastic_penalty(output.alphas, mask)  # (B,)
        loss = (-log_lik.sum(dim=1) + self.doubly_stochastic * penalty).mean()
        nll = (-log_lik.sum() / mask.sum().clamp(min=1)).detach()
        return LossOutput(
            loss=loss, nll=nll, metrics=_metrics(loss=loss, nll=nll, penalty=penalty.mean())
        )


class HardAttentionLoss(nn.Module):
    """Surrogate loss whose gradient is the REINFORCE learning rule of Sec. 4.1 (negated):

    -[log p(y|s̃,a) + λ_r (r - b) Σ_t log p(s̃_t|a) + λ_e H[α]], averaged over captions,
    with (r - b) a constant. Its expected gradient is -∂L_s/∂W (Eq. 11) plus the entropy and
    baseline terms. Captions whose α replaced s̃ (semi-sampling) get no REINFORCE term.
    The moving-average baseline b is a buffer, so it travels in ``state_dict``.
    """

    baseline: Tensor

    def __init__(
        self,
        lambda_r: float,
        lambda_e: float,
        baseline_decay: float,
        *,
        reward: str = "mean",
    ) -> None:
        super().__init__()
        if reward not in REWARDS:
            raise ValueError(f"unknown reward {reward!r}; expected one of {REWARDS}")
        if not 0.0 <= baseline_decay < 1.0:
            raise ValueError(f"baseline_decay must be in [0, 1), got {baseline_decay}")
        self.lambda_r = lambda_r
        self.lambda_e = lambda_e
        self.baseline_decay = baseline_decay
        self.reward = reward
        self.register_buffer("baseline", torch.zeros(()))  # b_0 = 0 (authors' code)

    def forward(self, output: ForwardOutput, captions: Tensor) -> LossOutput:
        targets, mask = _targets_and_mask(captions, output)
        steps = mask.sum(dim=1).clamp(min=1)  # (B,)
        log_lik = token_log_likelihood(output.logits, targets, mask).sum(dim=1)  # (B,)
        objective = log_lik
        stats: dict[str, Tensor] = {}
        if output.entropy is not None:
            entropy = _masked(output.entropy, mask).sum(dim=1)  # (B,) Σ_t H[α_t]
            objective = objective + self.lambda_e * entropy
            stats["entropy"] = entropy.mean()
        if output.sampled is not None and output.location_log_probs is not None:
            reward = (log_lik / steps if self.reward == "mean" else log_lik).detach()  # (B,)
            sampled = output.sampled.to(reward.dtype)  # (B,)
            advantage = (reward - self.baseline) * sampled  # (B,), zero where α replaced s̃
            path_log_prob = _masked(output.location_log_probs, mask).sum(dim=1)  # (B,) log p(s̃|a)
            objective = objective + self.lambda_r * advantage * path_log_prob
            stats.update(reward=reward.mean(), baseline=self.baseline.clone())
            if self.training:
                self._update_baseline(reward, sampled)
        loss = -objective.mean()
        nll = (-log_lik.sum() / mask.sum().clamp(min=1)).detach()
        return LossOutput(loss=loss, nll=nll, metrics=_metrics(loss=loss, nll=nll, **stats))

    @torch.no_grad()
    def _update_baseline(self, reward: Tensor, sampled: Tensor) -> None:
        """b_k = 0.9 b_{k-1} + 0.1 mean r (Sec. 4.1), over the captions that sampled s̃."""
        count = sampled.sum()
        mean_reward = (reward * sampled).sum() / count.clamp(min=1)
        updated = self.baseline_decay * self.baseline + (1 - self.baseline_decay) * mean_reward
        # a batch where semi-sampling used α everywhere says nothing about sampled paths
        self.baseline.copy_(torch.where(count > 0, updated, self.baseline))


class SelfCriticalLoss(nn.Module):
    """-Σ_i A_i log p(w^i | a) over the drawn captions' tokens, divided by the token count
    (A_i the advantage): the REINFORCE surrogate of self-critical training
    (``sat_model.train.self_critical``), whose advantages come with the sampled batch."""

    def forward(self, output: ForwardOutput, captions: Tensor, advantages: Tensor) -> LossOutput:
        targets, mask = _targets_and_mask(captions, output)
        log_lik = token_log_likelihood(output.logits, targets, mask)  # (B*n, T)
        tokens = mask.sum().clamp(min=1)
        loss = -(advantages.unsqueeze(1) * log_lik).sum() / tokens
        nll = (-log_lik.sum() / tokens).detach()
        return LossOutput(loss=loss, nll=nll, metrics={})


def build_criterion(
    attention: str, train_cfg: SoftTrainConfig | HardTrainConfig
) -> SoftAttentionLoss | HardAttentionLoss:
    """The criterion for ``attention`` from its ``params.train.<attention>`` section."""
    if attention == "soft":
        if not isinstance(train_cfg, SoftTrainConfig):
            raise TypeError(f"soft attention needs SoftTrainConfig, got {type(train_cfg).__name__}")
        return SoftAttentionLoss(train_cfg.doubly_stochastic)
    if attention == "hard":
        if not isinstance(train_cfg, HardTrainConfig):
            raise TypeError(f"hard attention needs HardTrainConfig, got {type(train_cfg).__name__}")
        return HardAttentionLoss(train_cfg.lambda_r, train_cfg.lambda_e, train_cfg.baseline_decay)
    raise ValueError(f"unknown attention {attention!r}; expected 'soft' or 'hard'")
