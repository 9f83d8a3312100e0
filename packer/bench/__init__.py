"""What ``packer bench`` measures: ``run.py`` (the run and its report), ``phases.py`` and
``train.py`` (read, decode, loader and training-step phases), ``verdict.py``, ``models.py``,
``coldread.py`` and the three figures (``build.py``, ``efficiency.py``, ``epochs.py``,
``allcores.py``). The repository's other benchmarks live in ``benchmarks/``, outside the wheel;
the library never imports this package.
"""
