"""Datasets in object storage (``s3://``, ``gs://``, ``az://``, any fsspec URL).

``urls`` says what is a URL and how it is shown (credentials never are); ``retry`` which
failures are retried and for how long; ``objects.Store`` moves whole files (parallel ranged
GETs, verified; uploads); ``remote`` is a dataset there (what ``packer.stage`` reads from a
URL; ``upload_dataset``); ``cache.ShardCache`` keeps shards on a node's disk for reading
without staging; ``local`` makes a URL local for the read-only commands and merge;
``destination.Destination`` is where ``build`` uploads a dataset as it is built. The
clients (fsspec, s3fs, gcsfs, adlfs) are the ``cloud`` extra and are imported only when a
URL is used.
"""
from .cache import ShardCache
from .destination import Destination
from .objects import ObjectInfo, Store
from .remote import RemoteDataset, fetch_manifest, parse_manifest, upload_dataset
from .retry import NotFound
from .urls import CLOUD_EXTRA, Transfer, is_url, redact, redact_text

__all__ = ["CLOUD_EXTRA", "Destination", "NotFound", "ObjectInfo", "RemoteDataset",
           "ShardCache", "Store", "Transfer", "fetch_manifest", "is_url", "parse_manifest",
           "redact", "redact_text", "upload_dataset"]
