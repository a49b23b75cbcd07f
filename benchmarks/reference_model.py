"""A plain reference of the decoder's training step, as the paper's equations read.

Unfused and step by step, as in the most-used PyTorch tutorial: at every step t,
``W_a a_i + W_h h_{t-1} + b`` for all locations, tanh, ``w_att``, softmax (Eq. 4-5), the context
(soft: Σ α a; hard: a at a given s̃, Eq. 9), the gate β, ``nn.LSTMCell`` (Eq. 1-3) and the deep
output layer (Eq. 7). It reads the parameters of a ``ShowAttendTell`` but none of its code paths,
so that ``benchmarks/bench_model.py`` can time the project's step against it and
``tests/sat_model/test_reference_model.py`` can check that both give the same loss and gradients.
Dimensions as in docs/METHOD.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sat_model.data.vocab import PAD_ID
from sat_model.model.decoder import ForwardOutput, ShowAttendTell

__all__ = ["reference_forward", "reference_soft_loss"]


def reference_forward(
    model: ShowAttendTell, annotations: Tensor, captions: Tensor, locations: Tensor | None = None
) -> ForwardOutput:
    """Teacher-forced pass over ``captions[:, :-1]`` (B, T): soft attention, or hard attention at
    the forced ``locations`` (B, T) (no sampling, no semi-sampling)."""
    hard = model.config.attention == "hard"
    if hard and locations is None:
        raise ValueError("the reference's hard attention needs forced locations")
    att = model.attention
    a = _annotations(model, annotations)  # (B, L, D)
    mean = a.mean(dim=1)  # (B, D)
    h, c = torch.tanh(model.init_h(mean)), torch.tanh(model.init_c(mean))  # (B, n)
    inputs = captions[:, :-1]  # (B, T)
    logits, alphas, betas, log_probs, entropies = [], [], [], [], []
    for t in range(inputs.size(1)):
        embedded = model.embedding(inputs[:, t])  # (B, m)
        u = att.annotation_proj(a) + att.hidden_proj(h).unsqueeze(1)  # (B, L, A)
        e = att.score(torch.tanh(u)).squeeze(2)  # (B, L), Eq. 4
        alpha = torch.softmax(e, dim=1)  # Eq. 5
        if hard:
            log_alpha = torch.log_softmax(e, dim=1)
            s = locations[:, t]  # (B,)
            z = a[torch.arange(a.size(0)), s]  # (B, D), Eq. 9
            log_probs.append(log_alpha.gather(1, s.unsqueeze(1)).squeeze(1))
            entropies.append(-(alpha * log_alpha).sum(1))
        else:
            z = (alpha.unsqueeze(2) * a).sum(dim=1)  # (B, D), Σ α a
        beta = torch.sigmoid(model.gate(h)).squeeze(1)  # (B,)
        z = beta.unsqueeze(1) * z
        h, c = model.lstm(torch.cat([embedded, z], dim=1), (h, c))  # Eq. 1-3
        pre = embedded + model.hidden_out(h) + model.context_out(z)  # Eq. 7
        dropped = F.dropout(torch.tanh(pre), model.dropout.p, model.training)  # torch's own
        logits.append(model.out(dropped))  # (B, K)
        alphas.append(alpha)
        betas.append(beta)
    return ForwardOutput(
        logits=torch.stack(logits, 1),
        alphas=torch.stack(alphas, 1),
        betas=torch.stack(betas, 1),
        location_log_probs=torch.stack(log_probs, 1) if hard else None,
        entropy=torch.stack(entropies, 1) if hard else None,
        sampled=torch.ones(captions.size(0), dtype=torch.bool) if hard else None,
    )


def reference_soft_loss(
    output: ForwardOutput, captions: Tensor, doubly_stochastic: float
) -> Tensor:
    """Eq. 14 per caption, averaged over captions: the summed NLL of the unpadded tokens plus
    λ Σ_i (1 - Σ_t α_ti)^2 with padded steps left out of Σ_t."""
    targets = captions[:, 1:]  # (B, T)
    mask = (targets != PAD_ID).float()
    nll = F.cross_entropy(output.logits.transpose(1, 2), targets, reduction="none")  # (B, T)
    coverage = (output.alphas * mask.unsqueeze(2)).sum(dim=1)  # (B, L)
    penalty = ((1.0 - coverage) ** 2).sum(dim=1)  # (B,)
    return ((nll * mask).sum(dim=1) + doubly_stochastic * penalty).mean()


def _annotations(model: ShowAttendTell, annotations: Tensor) -> Tensor:
    """The annotations the decoder attends over: standardised, with cell coordinates if the
    model was built so (docs/METHOD.md, departures)."""
    if model.feature_mean is not None:
        annotations = (annotations - model.feature_mean) / model.feature_std
    if model.coords is not None:
        coords = model.coords.expand(annotations.size(0), -1, -1)
        annotations = torch.cat([annotations, coords], dim=2)
    return annotations
