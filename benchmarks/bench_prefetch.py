#!/usr/bin/env python3
"""How much GPU time does each way of feeding batches lose? (ResNet-50-like training step.)

Each mode feeds the same training step (``packer.bench.models``: ResNet-50, bf16 autocast,
channels_last, SGD; the one ``packer bench --cuda`` times) and is compared with that step on
a batch already resident on the GPU:

  resident    the same float batch, already on the GPU: the step's own speed (``real``)
  plain       float32 batches normalized on the CPU, ``.to(device)`` from pageable memory
              (the classic ToTensor + Normalize pipeline)
  pinned      uint8 batches in pinned memory, ``.to(device, non_blocking=True)``, then
              converted and normalized on the training stream
  prefetcher  uint8 pinned batches through ``packer.CUDAPrefetcher`` (side-stream copy and
              normalization, overlapped with the previous step)

By default batches come from a list of pre-made CPU tensors, so loading costs nothing and
only the host-to-device path is measured. ``--dataset PATH`` feeds a real PackedDataset
through ``make_loader`` (decode + RandomResizedCrop in workers) instead.

Reported per mode: images/s, step time, and
  data wait (ms/step) = step time of the mode - step time of ``resident``: the GPU time per
                        step lost to getting the batch in;
  starvation          = 1 - rate(mode) / rate(resident) = wait / step time of the mode: the
                        fraction of the GPU's time spent not training.
Each figure is the median of ``--repeats`` timed runs of ``--steps`` steps after warm-up.
``--model`` is a torchvision model, or built in ``resnet50`` (without torchvision) or
``tiny`` (a small CNN, for a quick run on the CPU). The measurement is
``benchlib.prefetch``.
"""
from __future__ import annotations

import argparse

from benchlib.prefetch import MODES, PrefetchOptions, bench_prefetch, check_modes, prefetch_table


def main(argv=None):
    d = PrefetchOptions()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=d.model)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--size", type=int, default=d.size)
    p.add_argument("--steps", type=int, default=d.steps, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--pool", type=int, default=d.pool, help="distinct synthetic batches")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dataset", help="a packed dataset to feed through make_loader instead")
    p.add_argument("--workers", type=int, default=None, help="loader workers (--dataset)")
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    try:
        modes = tuple(check_modes(args.modes))
    except ValueError as e:
        p.error(str(e))
    opts = PrefetchOptions(model=args.model, batch=args.batch, size=args.size, steps=args.steps,
                           repeats=args.repeats, warmup=args.warmup, pool=args.pool, modes=modes,
                           dataset=args.dataset, workers=args.workers, device=args.device)
    results = bench_prefetch(opts)
    print(prefetch_table(results, opts.batch))


if __name__ == "__main__":
    main()
