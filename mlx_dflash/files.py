"""Files written whole or not at all."""

import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional


@contextmanager
def written_whole(path, scratch: Optional[Path] = None, suffix: Optional[str] = None) -> Iterator[Path]:
    """A temporary name to write ``path``'s new contents to, renamed over
    ``path`` when the block ends and removed if it raises (a second Ctrl-C
    included). A reader, or another process writing the same file, never
    sees half a file, and a run killed while writing keeps the old one.

    The name is unique (two writers never share it) and ends in ``path``'s
    suffix, or ``suffix`` (MLX and matplotlib pick the format from it, and
    MLX adds ``.safetensors`` to a name without it). ``scratch``: a
    folder on the same file system to write in instead of ``path``'s own,
    where a half-written file beside it would be read (a model folder's
    ``*.safetensors``)."""
    path = Path(path)
    folder = path.parent if scratch is None else Path(scratch)
    tail = f".{os.getpid()}-{secrets.token_hex(4)}.tmp{path.suffix if suffix is None else suffix}"
    # A name the file system takes for ``path`` must take its temporary one too (255 bytes).
    stem = path.stem.encode()[: max(255 - len(tail.encode()), 1)].decode(errors="ignore")
    tmp = folder / f"{stem}{tail}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path, text: str) -> None:
    """``path``'s text replaced whole (see :func:`written_whole`)."""
    with written_whole(path) as tmp:
        tmp.write_text(text)


@contextmanager
def left_only_if_used(*folders) -> Iterator[None]:
    """Of ``folders`` (None skipped), those not there yet, with the parents
    made for them, are removed again if the block raises and leaves them
    empty: a failed run leaves behind no empty folder it made."""
    new = []  # (folder, the highest of its parents not there yet)
    for f in folders:
        if f is None:
            continue
        p = top = Path(f).expanduser().absolute()
        while not top.parent.exists() and top.parent != top:
            top = top.parent
        if not p.exists():
            new.append((p, top))
    try:
        yield
    except BaseException:
        for p, top in new:
            while p.is_dir() and not any(p.iterdir()):
                p.rmdir()
                if p == top:
                    break
                p = p.parent
        raise
