"""What ``packer bench`` measures (other benchmarks: ``benchmarks/``); the library never uses it."""
