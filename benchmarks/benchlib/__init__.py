"""What the benchmark scripts beside this folder compute; not part of the packer wheel."""
