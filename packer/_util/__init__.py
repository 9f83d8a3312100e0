"""What several of packer's modules share; internal, not API (map: docs/architecture.md)."""
