"""What ``packer bench`` measures (``run.py``, its phases and figures); the repository's other
benchmarks live in ``benchmarks/``. The library never imports this package."""
