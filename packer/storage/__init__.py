"""Datasets in object storage (``s3://``, ``gs://``, ``az://``, any fsspec URL). The clients
(the ``cloud`` extra) are imported only when a URL is used."""
from .cache import ShardCache
from .destination import Destination
from .objects import NotFound, ObjectInfo, Store
from .remote import RemoteDataset, fetch_manifest, parse_manifest, upload_dataset
from .urls import CLOUD_EXTRA, Transfer, is_url, redact, redact_text

__all__ = ["CLOUD_EXTRA", "Destination", "NotFound", "ObjectInfo", "RemoteDataset",
           "ShardCache", "Store", "Transfer", "fetch_manifest", "is_url", "parse_manifest",
           "redact", "redact_text", "upload_dataset"]
