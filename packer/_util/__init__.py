"""What several of packer's modules share: machine facts (``system``), safe file
creation (``fsio``), printable text (``text``), thread hand-offs (``threads``), lazy
exports (``lazy``). Internal: not part of the API."""
