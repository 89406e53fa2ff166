"""Small models and data shared by the PyTorch shim tests (workers import this too)."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                                 nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3),
                                      nn.ReLU())
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Branchy(nn.Module):
    """An MLP with an extra layer that a step may skip (unused parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        self.extra = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        out = self.body(x)
        return self.extra(out) if use_extra else out


class Normed(nn.Module):
    """An MLP with BatchNorm: float buffers and an int64 one (num_batches_tracked)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(),
                                 nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {"mlp": MLP, "cnn": CNN, "branchy": Branchy, "normed": Normed}[kind]()


def batch(kind: str, step: int, rank: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of step `step`: the same on every call, different per rank."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "cnn":
        return torch.randn(size, 1, 8, 8, generator=gen), torch.randint(0, 10, (size,),
                                                                          generator=gen)
    return torch.randn(size, 16, generator=gen), torch.randn(size, 4, generator=gen)


def loss_of(kind: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "cnn":
        return nn.functional.cross_entropy(output, target)
    return nn.functional.mse_loss(output, target)
