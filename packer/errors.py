"""The one exception type packer raises for a user's mistake or a bad dataset. Messages say what
went wrong *and what to do*; the CLI prints them as one ``Error:`` line."""


class PackerError(Exception):
    """A problem the user can fix: bad input, a damaged or incomplete dataset, no space."""


class FormatError(PackerError):
    """A dataset on disk is incomplete, damaged, or written by a newer packer."""
