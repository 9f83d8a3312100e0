"""packer: pack image folders into LMDB shards and feed GPUs without waiting on input."""
__version__ = "0.1.0"
