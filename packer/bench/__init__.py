"""Benchmark machinery: what ``packer bench`` and ``scripts/bench_*.py`` measure.

    run.py       run_bench / BenchReport: the ``packer bench`` run, its table, JSON and plot
    phases.py    the read, decode and loader phases; train.py: the training-step phase
    verdict.py   what bounds the pipeline, in sentences quoting the numbers
    models.py    the models and the training step every benchmark times
    coldread.py  cold reads: drop the page cache, throttle a disk (cgroup blkio), count reads
    build.py, order.py, stage.py, prefetch.py, gpu*.py: what each scripts/bench_*.py computes

Only benchmarks use this package; the library never imports it.
"""
