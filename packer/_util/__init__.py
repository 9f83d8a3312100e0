"""What several of packer's modules share (map: docs/architecture.md). Internal: not part of
the API."""
