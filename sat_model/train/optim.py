"""The optimisers of Sec. 5 and the per-epoch learning-rate schedules, by their params names."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["build_optimizer", "build_scheduler"]


def build_optimizer(
    parameters: Iterable[nn.Parameter], name: str, lr: float, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """Adam (Flickr30k, COCO) or RMSProp (Flickr8k), as in Sec. 5."""
    params = [p for p in parameters if p.requires_grad]
    if name == "adam":
        # one fused kernel for all parameters rather than a loop over them, faster on CPU and
        # GPU alike: the same update up to float rounding
        fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; expected 'adam' or 'rmsprop'")


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, max_epochs: int, lr_decay: float
) -> torch.optim.lr_scheduler.LRScheduler:
    """A learning-rate schedule stepped once per epoch."""
    sched = torch.optim.lr_scheduler
    if schedule == "constant":
        return sched.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if schedule == "cosine":
        return sched.CosineAnnealingLR(optimizer, T_max=max_epochs)
    if schedule == "step":
        return sched.StepLR(optimizer, step_size=1, gamma=lr_decay)
    raise ValueError(f"unknown lr_schedule {schedule!r}; expected constant, cosine or step")
