"""The one exception type for errors a user can cause."""


class DFlashError(Exception):
    """Bad input: a missing file, a mismatched draft, an out-of-range option.

    The message names the cause; the CLI prints it and exits with status 2.
    """
