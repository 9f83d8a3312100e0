"""``packer.bench.models``: the one copy of the models and the training step that ``packer
bench``, ``benchmarks/bench_prefetch.py`` and ``scripts/train_example.py`` use."""
import copy
import runpy
from pathlib import Path

import pytest
import torch
from torch import nn

from packer.bench.models import TinyNet, TrainStep, make_model
from packer.errors import PackerError

REPO = Path(__file__).resolve().parents[2]


def test_tiny_is_the_small_cnn():
    net = make_model("tiny", 7)
    assert isinstance(net, TinyNet)
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 7)
    assert 350_000 < sum(p.numel() for p in net.parameters()) < 450_000  # ~0.4M
    assert any(isinstance(m, nn.BatchNorm2d) for m in net.modules())  # --sync-bn has work to do
    # channels_last works end to end (what the benchmarks and --channels-last use)
    net = net.to(memory_format=torch.channels_last)
    x = torch.zeros(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    assert net(x).shape == (2, 7)


def test_unknown_model_is_a_packer_error():
    with pytest.raises(PackerError, match="no-such-model"):
        make_model("no-such-model", 10)


def test_default_step_trains_and_returns_the_loss():
    torch.manual_seed(0)
    net = make_model("tiny", 4)
    step = TrainStep(net, torch.device("cpu"))
    x = step.normalize(torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8))
    assert x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
    before = [p.detach().clone() for p in net.parameters()]
    loss = step(x, torch.tensor([0, 1, 2, 3]))
    assert loss.ndim == 0 and not loss.requires_grad and torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert all(p.grad is None for p in net.parameters())  # zeroed (set to None) after the update


def test_custom_step_matches_the_hand_written_loop():
    """What train_example passes: its optimizer, criterion, no autocast, a scaler, a schedule."""
    torch.manual_seed(0)
    net = make_model("tiny", 3)
    ref = copy.deepcopy(net)
    x, y = torch.randn(6, 3, 32, 32), torch.tensor([0, 1, 2, 0, 1, 2])

    def parts(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        return (opt, nn.CrossEntropyLoss(label_smoothing=0.1),
                torch.amp.GradScaler("cuda", enabled=False),
                torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)))

    opt, crit, scaler, sched = parts(net)
    step = TrainStep(net, torch.device("cpu"), optimizer=opt, criterion=crit, amp=None,
                     scaler=scaler, scheduler=sched)
    r_opt, r_crit, r_scaler, r_sched = parts(ref)
    for _ in range(3):
        loss = step(x, y)
        r_loss = r_crit(ref(x), y)
        r_opt.zero_grad(set_to_none=True)
        r_scaler.scale(r_loss).backward()
        r_scaler.step(r_opt)
        r_scaler.update()
        r_sched.step()
        assert torch.allclose(loss, r_loss.detach())
    assert sched.last_epoch == 3
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(a, b)


def test_train_example_uses_these_models():
    g = runpy.run_path(str(REPO / "scripts" / "train_example.py"), run_name="train_example")
    assert "TinyNet" not in g and g["make_model"] is make_model and g["TrainStep"] is TrainStep
    assert isinstance(g["build_model"]("tiny", 5), TinyNet)
    with pytest.raises(SystemExit, match="--model no-such-model"):
        g["build_model"]("no-such-model", 5)
