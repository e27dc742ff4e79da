"""The one error type of the data layer."""


class DataError(ValueError):
    """Bad data input; the message names the file (and row) and the fix."""
