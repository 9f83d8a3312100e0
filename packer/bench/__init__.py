"""What ``packer bench`` measures (the repository's other benchmarks live in ``benchmarks/``,
outside the wheel, and use this package too).

    run.py       run_bench / BenchReport: the ``packer bench`` run, its table, JSON and plot
    phases.py    the read, decode and loader phases; train.py: the training-step phase
    verdict.py   what bounds the pipeline, in sentences quoting the numbers
    models.py    the models and the training step every benchmark times
    coldread.py  cold reads: drop the page cache, throttle a disk (cgroup blkio), count reads
    build.py, efficiency.py, epochs.py, allcores.py: the three figures on a sample of DST

The library never imports this package.
"""
