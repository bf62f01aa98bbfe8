"""The one exception type for errors a user can cause, and the checks of user input shared by the modules."""

import math
import numbers


class DFlashError(Exception):
    """Bad input: a missing file, a mismatched draft, an out-of-range option.

    The message names the cause; the CLI prints it and exits with status 2.
    """


class UnreadableFile(DFlashError):
    """A file that cannot be read at all (truncated, corrupt), or a model
    whose files contradict themselves (weights missing, or not the ones its
    own config names): bad input, never an answer such as "this draft does
    not fit that target"."""


def check_positive(value, what: str, unit: str = "number") -> None:
    """A DFlashError naming ``what`` unless ``value`` is a finite number above
    0 (written so: NaN compares false to every bound, and passed ``<= 0``)."""
    if not (isinstance(value, numbers.Real) and value > 0 and math.isfinite(value)):
        raise DFlashError(f"{what} must be a positive {unit}, got {value}")


def is_count(value, least: int = 1) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``least``."""
    return is_int(value) and value >= least


def is_int(value) -> bool:
    """Whether ``value`` is an integer (Python's or numpy's), bools not counted."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_text(text: str, what: str) -> None:
    """A DFlashError naming ``what`` if ``text`` is not valid Unicode: a lone
    surrogate (a JSON escape such as \\ud800, or an invalid UTF-8 byte kept by
    Python as one when it read the command line or a file)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        shown = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"\\u{ord(bad):04x}"
        raise DFlashError(f"{what} is not valid UTF-8 text ({shown} at character {e.start})") from None


def writable_file(path, label: str) -> None:
    """One error naming ``label`` now, rather than after the work (or with a
    temporary file's name), for a file path that could not be written."""
    import os
    from pathlib import Path

    path = Path(path).expanduser()
    if path.is_dir():
        raise DFlashError(f"{label} {path} is a folder; give a file path")
    folder = path.parent
    if not folder.is_dir():
        raise DFlashError(f"{label} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise DFlashError(f"{label} {path}: the folder {folder} is not writable")


def writable_folder(path, label: str):
    """Make the folder ``path`` (parents too) and check it is writable, with
    one error naming ``label`` otherwise: done before long work, so its
    results are never lost to a folder that cannot take them."""
    import os
    from pathlib import Path

    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise DFlashError(f"the {label} {p} is a file; give a folder path")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashError(f"cannot make the {label} {p}: {e.strerror or e}") from None
    if not os.access(p, os.W_OK):
        raise DFlashError(f"the {label} {p} is not writable")
    return p


def token_ids(prompt) -> list:
    """A prompt given as token ids (a list, tuple or array of integers), as a
    list; anything else is one error (bytes are not ids, 2.5 is not rounded)."""
    if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):
        prompt = prompt.tolist()  # an mx or numpy array
    if not isinstance(prompt, (list, tuple)):
        raise DFlashError(f"a prompt is text or a list of token ids, got {type(prompt).__name__}")
    for t in prompt:
        if not is_int(t):
            raise DFlashError(f"a prompt's token ids must be integers, got {t!r}")
    return [int(t) for t in prompt]
