"""Which BLAS this process uses, and a re-exec under OpenBLAS on Linux.

mlx-cpu bundles the netlib reference BLAS, whose batched matmul cost grows
linearly with the batch (a 16-token verify runs ~7x slower than with
OpenBLAS). The command line (cli.main) re-executes itself once with
OpenBLAS preloaded when it is installed (Debian package
libopenblas0-pthread), for every command; ``bench --blas bundled`` opts out.
"""

import glob
import os
import platform
import sys

_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
] + glob.glob("/usr/lib/*/openblas*/libblas.so.3")


def openblas_path():
    for p in _CANDIDATES:
        if os.path.exists(p):
            return p
    return None


def ensure_openblas(mode: str = "auto", argv=None) -> None:
    """Re-exec this process with OpenBLAS preloaded when asked and available.

    ``argv``: the command line to re-run (default: this interpreter + sys.argv).
    """
    if platform.system() != "Linux":
        return
    pre = os.environ.get("LD_PRELOAD", "")
    if mode == "bundled":
        if "openblas" in pre:  # preloaded by the command line entry: run again without it
            env = dict(os.environ, LD_PRELOAD=" ".join(p for p in pre.split() if "openblas" not in p))
            argv = argv or [sys.executable] + sys.argv
            os.execve(argv[0], argv, env)
        return
    lib = openblas_path()
    if lib is None:
        if mode == "openblas":
            from .errors import DFlashError

            raise DFlashError("OpenBLAS not found: apt-get install libopenblas0-pthread")
        return
    if lib in pre:
        return
    env = dict(os.environ, LD_PRELOAD=f"{lib} {pre}".strip())
    argv = argv or [sys.executable] + sys.argv
    os.execve(argv[0], argv, env)


def describe() -> str:
    if platform.system() == "Darwin":
        return "Apple Accelerate / Metal (macOS)"
    pre = os.environ.get("LD_PRELOAD", "")
    if "openblas" in pre:
        return f"OpenBLAS preloaded ({pre})"
    return "mlx-cpu bundled reference BLAS (OpenBLAS not preloaded)"
