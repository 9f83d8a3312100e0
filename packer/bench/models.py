"""The models and the training step every benchmark times: one copy, so their numbers compare."""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
from torch import nn

from ..errors import PackerError
from ..loading.prefetch import IMAGENET_MEAN, IMAGENET_STD, normalize_uint8

__all__ = ["TinyNet", "TrainStep", "make_model", "resnet50"]


class TrainStep:
    """One training step (autocast forward, loss, backward, optimizer and scheduler step); returns
    the detached loss. Default: bf16, cross-entropy, SGD (lr 0.01, momentum 0.9); a training
    script passes its own ``optimizer``, ``criterion``, ``amp``, ``scaler``, ``scheduler``."""

    def __init__(self, net: nn.Module, device: torch.device, *,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 criterion: Optional[nn.Module] = None,
                 amp: Optional[torch.dtype] = torch.bfloat16,
                 scaler: Optional["torch.amp.GradScaler"] = None,
                 scheduler: Optional["torch.optim.lr_scheduler.LRScheduler"] = None):
        self.net, self.device = net, device
        self.opt = optimizer if optimizer is not None else torch.optim.SGD(
            net.parameters(), lr=0.01, momentum=0.9)
        self.loss = criterion if criterion is not None else nn.CrossEntropyLoss()
        self.amp, self.scaler, self.scheduler = amp, scaler, scheduler
        mean = torch.tensor(IMAGENET_MEAN).view(1, -1, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(1, -1, 1, 1)
        self.scale, self.shift = (1 / (255 * std)).to(device), (-mean / std).to(device)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 -> float32 normalized, channels_last: what CUDAPrefetcher does, done in-loop."""
        return normalize_uint8(x, self.scale, self.shift, channels_last=True)

    def autocast(self):
        """The forward pass's autocast context (a no-op one when ``amp`` is None)."""
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            loss = self.loss(self.net(x), y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        return loss.detach()


def make_model(name: str, num_classes: int) -> nn.Module:
    """``tiny``; ``torchvision.models.<name>`` when torchvision is installed; else the built-in
    ``resnet50`` (torchvision's layout). Randomly initialised; ``PackerError`` for other names."""
    if name == "tiny":
        return TinyNet(num_classes)
    try:
        import torchvision
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    except ImportError:
        pass
    except ValueError as e:
        raise PackerError(f"model {name!r}: {e}") from None
    if name != "resnet50":
        raise PackerError(f"model {name!r} needs torchvision (pip install torchvision); "
                          f"built in: resnet50, tiny")
    return resnet50(num_classes)


class TinyNet(nn.Module):
    """A small CNN (~0.4M parameters, with BatchNorm) for CPU runs and CI."""

    def __init__(self, num_classes: int, width: int = 32):
        super().__init__()
        layers: List[nn.Module] = []
        c_in = 3
        for c_out in (width, width * 2, width * 4, width * 8):
            layers += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False),
                       nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.body(x) + self.skip(x))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50 (v1.5: stride in the 3x3 conv, as torchvision), randomly initialised."""
    layers: List[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(_Bottleneck(cin, width, stride if b == 0 else 1))
            cin = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)
