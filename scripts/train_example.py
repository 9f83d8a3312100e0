#!/usr/bin/env python3
"""Train an image classifier from a packed dataset: one GPU, several GPUs, or the CPU.

The whole input pipeline is three packer objects: ``PackedDataset`` (decode + random
resized crop straight to uint8), ``make_loader`` (uint8 batches in pinned memory) and
``CUDAPrefetcher`` (copy on a side stream, normalize on the GPU). ``PackedSampler`` splits
each epoch across ranks and makes a mid-epoch resume exact.

    # build once (packer build SRC DST), then:
    python scripts/train_example.py --data /data/packed/train --val /data/packed/val
    torchrun --standalone --nproc_per_node=8 scripts/train_example.py \\
        --data /data/packed/train --val /data/packed/val --stage-to /dev/shm/packer \\
        --amp bf16 --channels-last --checkpoint ckpt.pt
    python scripts/train_example.py --data DST --cpu --model tiny --max-steps 5   # CI path

Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set) it runs DDP: NCCL on GPUs, gloo on the
CPU. Rank 0 logs and writes checkpoints. The last line is machine-parsable:
``RESULT images_per_s=... world_size=... ...`` (global images/s over the timed steps, i.e.
without each epoch's first steps, which pay for worker start-up, cuDNN autotuning and
torch.compile).

Models: any torchvision model by name when torchvision is installed; built in, the small CNN
``tiny`` (the CPU default) and a ResNet-50 with torchvision's layout (the GPU default, used
when torchvision is missing).
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import packer
from packer.bench.models import TrainStep, make_model
from packer.errors import PackerError
from packer.loading.loader import make_loader
from packer.loading.prefetch import CUDAPrefetcher
from packer.reading.sampler import PackedSampler
from packer.staging import stage_once_per_node


# -- model -------------------------------------------------------------------------------------

def build_model(name: str, num_classes: int) -> nn.Module:
    """``tiny`` (a small CNN with BatchNorm); a torchvision model by name; or, without
    torchvision, packer's built-in ResNet-50 (torchvision's architecture), so GPU runs
    measure a real model anywhere. The models ``packer bench`` trains: one copy."""
    try:
        return make_model(name, num_classes)
    except PackerError as e:
        hint = ("" if importlib.util.find_spec("torchvision") else
                "; after installing torchvision, run scripts/install_pillow_simd.sh again")
        raise SystemExit(f"--model {name}: {e}{hint}") from None


# -- distributed set-up ------------------------------------------------------------------------

class Dist:
    """Rank, world size and device of this process; DDP when launched by torchrun."""

    def __init__(self, cpu: bool):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.cuda = torch.cuda.is_available() and not cpu
        if self.cuda:
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            # One process per core group: without this each rank starts a thread per core.
            local = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world)))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
        self.distributed = self.world > 1
        if self.distributed:
            dist.init_process_group("nccl" if self.cuda else "gloo",
                                    device_id=self.device if self.cuda else None)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def log(self, *msg) -> None:
        if self.main:
            print(*msg, flush=True)

    def sum(self, *values: float):
        """All-reduced sums (the values themselves without DDP)."""
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return tuple(t.tolist())

    def max(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def close(self) -> None:
        if self.distributed:
            dist.destroy_process_group()


# -- data --------------------------------------------------------------------------------------

def data_root(args, d: Dist, path: str, name: str) -> str:
    """The dataset to read: ``path`` itself, or its copy staged once per node."""
    if not args.stage_to:
        return path
    res = stage_once_per_node(path, Path(args.stage_to) / name, progress=d.local_rank == 0)
    if d.local_rank == 0 and not res.waited:
        print(f"[node of rank {d.rank}] {res.message()}", flush=True)
    return str(res.target)


def loaders(args, d: Dist):
    train_ds = packer.PackedDataset(data_root(args, d, args.data, "train"),
                                    decode=packer.DecodeRandomResizedCrop(args.image_size))
    train_sampler = PackedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train = make_loader(train_ds, args.batch_size, sampler=train_sampler, drop_last=True,
                        num_workers=args.workers)
    if len(train) == 0:
        raise SystemExit(f"{args.data} has {len(train_ds)} images: fewer than one batch of "
                         f"{args.batch_size} per rank x {d.world} ranks; lower --batch-size")
    val = None
    if args.val:
        val_ds = packer.PackedDataset(data_root(args, d, args.val, "val"),
                                      decode=packer.DecodeCenterCrop(args.image_size))
        if val_ds.classes != train_ds.classes:
            raise SystemExit(f"{args.val} has other classes than {args.data}")
        # Padded to equal counts per rank (a few images counted twice when the size is not a
        # multiple of the world size): equal counts keep the ranks in step.
        val_sampler = PackedSampler(val_ds, shuffle=False)
        val = make_loader(val_ds, args.batch_size, sampler=val_sampler, num_workers=args.workers)
    kw = dict(device=d.device, channels_last=args.channels_last)
    return (train_ds, train_sampler, CUDAPrefetcher(train, **kw),
            CUDAPrefetcher(val, **kw) if val is not None else None)


# -- training ----------------------------------------------------------------------------------

def _int_at_least(low: int):
    """An argparse type: an int >= low (a bad value is a usage error, not a traceback later)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def _float_in(low: float, high: float = math.inf, low_open: bool = False):
    """An argparse type: a float in [low, high] ((low, high] with low_open)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            bounds = (f"in [{low:g}, {high:g}]" if high < math.inf else
                      f"{'>' if low_open else '>='} {low:g}")
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value
    return parse


def parse_args(argv=None):
    positive = _int_at_least(1)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, metavar="DST", help="packed training dataset (packer build)")
    p.add_argument("--val", metavar="DST", help="packed validation dataset (same classes)")
    p.add_argument("--stage-to", metavar="DIR",
                   help="copy the datasets to DIR/train and DIR/val first, once per node "
                        "(e.g. /dev/shm/packer), and read them there; `packer unstage` frees them")
    p.add_argument("--epochs", type=positive, default=1, metavar="N", help="default: 1")
    p.add_argument("--max-steps", type=positive, metavar="N", help="stop after N optimizer steps in all")
    p.add_argument("--batch-size", type=positive, default=256, metavar="N",
                   help="images per step per process (default: 256)")
    p.add_argument("--lr", type=_float_in(0, low_open=True), metavar="X",
                   help="peak learning rate (default: 0.1 x global batch / 256, the linear "
                        "scaling rule); SGD, Nesterov momentum 0.9, warm-up then cosine decay")
    p.add_argument("--weight-decay", type=_float_in(0), default=5e-5, metavar="X",
                   help="on weights, not on BatchNorm or biases (default: 5e-5)")
    p.add_argument("--label-smoothing", type=_float_in(0, 1), default=0.1, metavar="X", help="default: 0.1")
    p.add_argument("--image-size", type=positive, default=224, metavar="N",
                   help="training crop and validation center crop (default: 224)")
    p.add_argument("--workers", type=_int_at_least(0), metavar="N",
                   help="DataLoader workers per process (default: usable cores / processes per node)")
    p.add_argument("--model", metavar="NAME",
                   help="a torchvision model, or built in: tiny, resnet50 (used without "
                        "torchvision) (default: resnet50 on GPU, tiny on CPU)")
    p.add_argument("--amp", choices=("bf16", "fp16", "none"),
                   help="autocast dtype (default: bf16 on GPUs that support it, else none)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC memory format for model and batches (default: on with CUDA)")
    p.add_argument("--sync-bn", action="store_true",
                   help="SyncBatchNorm across GPUs (for small per-GPU batches; a collective per BN layer)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels, no cuDNN autotuning (slower; for debugging)")
    p.add_argument("--checkpoint", metavar="PATH",
                   help="rank 0 saves here after every epoch, every 1000 steps and at the end")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint (at the exact sample) if it exists")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if CUDA is available")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="data order and init (default: 0)")
    p.add_argument("--log-every", type=positive, default=50, metavar="N",
                   help="steps between progress lines (default: 50)")
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint PATH")
    if args.checkpoint and not os.path.isdir(os.path.dirname(os.path.abspath(args.checkpoint))):
        p.error(f"--checkpoint {args.checkpoint}: its folder does not exist")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    d = Dist(args.cpu)
    try:
        return train(args, d)
    except PackerError as e:  # a missing or damaged dataset, a failed staging: one line
        raise SystemExit(f"error: {e}") from None
    finally:
        d.close()


def train(args, d: Dist) -> int:
    torch.manual_seed(args.seed + d.rank)
    if args.model is None:
        args.model = "resnet50" if d.cuda else "tiny"
    if args.channels_last is None:
        args.channels_last = d.cuda
    if args.amp is None:
        args.amp = "bf16" if d.cuda and torch.cuda.is_bf16_supported() else "none"
    if d.cuda:
        # cuDNN tries each convolution algorithm once per input shape and keeps the fastest:
        # a win with fixed image sizes (as here); deterministic mode forbids it.
        torch.backends.cudnn.benchmark = not args.deterministic
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    train_ds, sampler, train_iter, val_iter = loaders(args, d)
    num_classes = len(train_ds.classes)
    model = build_model(args.model, num_classes).to(d.device)
    if args.sync_bn and d.distributed:
        if d.cuda:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        else:
            d.log("note: --sync-bn ignored: SyncBatchNorm needs CUDA")
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    global_batch = args.batch_size * d.world
    lr = args.lr if args.lr is not None else 0.1 * global_batch / 256
    # No weight decay on BN and bias parameters: the usual ImageNet recipe.
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": args.weight_decay},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=lr, momentum=0.9, nesterov=True)
    steps_per_epoch = len(train_iter)
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    warmup = min(max(1, total_steps // 20), 5 * steps_per_epoch)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp == "fp16" and d.cuda)

    start_epoch, step, done_in_epoch = 0, 0, 0
    if args.resume and args.checkpoint and os.path.exists(args.checkpoint):
        try:
            ck = torch.load(args.checkpoint, map_location=d.device, weights_only=True)
        except Exception:  # truncated, or another file: one line, not torch's page of advice
            raise SystemExit(f"error: --checkpoint {args.checkpoint}: not a checkpoint this "
                             f"script wrote, or a damaged one: remove it or give another path"
                             ) from None
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        sampler.load_state_dict(ck["sampler"])  # exact position, even at another world size
        start_epoch, step = ck["sampler"]["epoch"], ck["step"]
        done_in_epoch = ck["sampler"]["consumed"] // global_batch
        d.log(f"resumed from {args.checkpoint}: epoch {start_epoch + 1}, step {step}")

    net = model
    if d.distributed:
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[d.local_rank] if d.cuda else None, gradient_as_bucket_view=True)
    if args.compile:
        net = torch.compile(net)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    # Forward under autocast, loss, backward (scaled for fp16), SGD update, LR schedule step:
    # the training step packer's benchmarks time, with this script's optimizer and schedule.
    train_step = TrainStep(net, d.device, optimizer=opt, criterion=criterion, amp=amp_dtype,
                           scaler=scaler, scheduler=sched)

    d.log(f"{args.data}: {len(train_ds)} images, {num_classes} classes | model {args.model}, "
          f"{d.world} process(es) on {d.device.type}"
          f"{' (' + torch.cuda.get_device_name(d.device) + ')' if d.cuda else ''}, batch "
          f"{args.batch_size}/process ({global_batch} global), {steps_per_epoch} steps/epoch, "
          f"lr {lr:g}, amp {args.amp}, channels_last {args.channels_last}, "
          f"compile {args.compile}, sync_bn {args.sync_bn and d.distributed and d.cuda}")

    timed_images, timed_seconds = 0.0, 0.0
    stop = False
    for epoch in range(start_epoch, args.epochs):
        if stop or step >= total_steps:
            break
        train_iter.set_epoch(epoch)  # reaches the sampler: a new order each epoch
        net.train()
        n_steps = len(train_iter)
        skip = min(20, n_steps // 5)  # start-up steps left out of the timed window
        loss_sum = torch.zeros((), device=d.device)
        t_epoch = time.perf_counter()
        t_window = None
        ran = 0  # steps this pass
        for images, labels in train_iter:
            if ran == skip:
                _sync(d)
                t_window = time.perf_counter()
            loss = train_step(images, labels)
            loss_sum += loss
            step += 1
            ran += 1
            done_in_epoch += 1
            if ran % args.log_every == 0:
                d.log(f"epoch {epoch + 1} step {ran}/{n_steps}: loss {loss.item():.3f}, "
                      f"lr {sched.get_last_lr()[0]:.4f}")
            if step >= total_steps:
                stop = True
                break
            if args.checkpoint and step % 1000 == 0:  # mid-epoch: resumable at this exact sample
                save(args, d, model, opt, sched, scaler,
                     sampler.state_dict(consumed=done_in_epoch * global_batch), step)
        _sync(d)
        now = time.perf_counter()
        seconds = d.max(now - t_epoch)  # the slowest rank's time: all ranks' images are done
        timed = ran - skip if t_window is not None else 0
        (loss_total,) = d.sum(loss_sum.item())
        msg = (f"epoch {epoch + 1}/{args.epochs}: {ran} steps, loss {loss_total / d.world / max(1, ran):.3f}, "
               f"{ran * global_batch / seconds:.0f} images/s (global, whole epoch, {seconds:.1f} s)")
        if timed > 0:
            window = d.max(now - t_window)
            timed_images += timed * global_batch
            timed_seconds += window
            msg += f", {timed * global_batch / window:.0f} images/s after {skip} start-up steps"
        if val_iter is not None:
            msg += f", val top-1 {evaluate(net, val_iter, d, train_step.autocast):.2%}"
        d.log(msg)
        if args.checkpoint:
            state = sampler.state_dict(consumed=done_in_epoch * global_batch)
            if ran == n_steps:  # epoch finished: a resume starts the next one at its first sample
                state.update(epoch=epoch + 1, consumed=0)
            save(args, d, model, opt, sched, scaler, state, step)
        done_in_epoch = 0

    rate = timed_images / timed_seconds if timed_seconds else float("nan")
    d.log(f"RESULT images_per_s={rate:.1f} per_process={rate / d.world:.1f} world_size={d.world} "
          f"steps={step} batch_size={args.batch_size} model={args.model} amp={args.amp} "
          f"channels_last={int(args.channels_last)} compile={int(args.compile)} "
          f"device={'cuda' if d.cuda else 'cpu'}")
    return 0


def _sync(d: Dist) -> None:
    if d.cuda:
        torch.cuda.synchronize(d.device)


@torch.no_grad()
def evaluate(net, val_iter, d: Dist, autocast) -> float:
    net.eval()
    correct = torch.zeros((), device=d.device)
    seen = 0
    for images, labels in val_iter:
        with autocast():
            correct += (net(images).argmax(1) == labels).sum()
        seen += labels.numel()
    c, n = d.sum(correct.item(), seen)
    return c / max(1, n)


def save(args, d: Dist, model, opt, sched, scaler, sampler_state: dict, step: int) -> None:
    """Rank 0 writes the checkpoint atomically (a crash mid-write keeps the previous one)."""
    if d.main:
        tmp = args.checkpoint + ".tmp"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
                    "sampler": sampler_state, "step": step, "args": vars(args)}, tmp)
        os.replace(tmp, args.checkpoint)
    if d.distributed:
        dist.barrier()  # nobody runs ahead (or exits) before the checkpoint is complete


if __name__ == "__main__":
    sys.exit(main())
