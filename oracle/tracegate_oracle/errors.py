"""The oracle's user errors: the CLI prints one line and exits 2 (as the engine and contract do)."""


class OracleError(Exception):
    """A user error (bad argument, path, checkpoint or input trace): exit 2, no traceback."""


class CheckpointError(OracleError):
    """The checkpoint is malformed, or it and the model class disagree about which tensors exist."""
