"""Exceptions that carry a message meant for the user (the CLI prints it alone)."""


class LipvitError(Exception):
    """A user-facing error: bad input, a missing/corrupt file, an unsupported model."""


class CheckpointError(LipvitError):
    """A checkpoint file is missing, truncated, foreign or from a newer lipvit."""


class DataError(LipvitError):
    """A dataset directory is missing or its files are malformed."""


class UnsupportedModelError(LipvitError):
    """A bound or method cannot handle this architecture (the message says why)."""
