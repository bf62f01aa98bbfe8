"""Which BLAS this process uses, and a re-exec under OpenBLAS on Linux.

mlx-cpu bundles the netlib reference BLAS, whose batched matmul cost grows
linearly with the batch (a 16-token verify runs ~7x slower than with
OpenBLAS). The command line (cli.main) re-executes itself once with
OpenBLAS preloaded when it is installed (Debian package
libopenblas0-pthread), for every command; ``bench --blas bundled`` opts out.

OpenBLAS then gets one thread fewer than the cores this process may use:
while MLX's CPU thread computes a step, the Python thread is already
queuing the next one, and BLAS workers on every core would take turns with
it. On a 2-core machine one BLAS thread decoded up to 29% faster than two,
side by side, this engine and mlx-lm alike; a long prefill took 12% longer
(bench/results/blas-threads.md).
"""

import ctypes
import glob
import os
import platform
import signal
import sys

_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
] + glob.glob("/usr/lib/*/openblas*/libblas.so.3")


MODES = ("auto", "openblas", "bundled")
HELP = "Linux: 'auto' preloads OpenBLAS when installed, 'openblas' requires it, 'bundled' keeps mlx's reference BLAS."


def add_flag(parser) -> None:
    """The ``--blas`` flag of the bench and tool scripts (an argparse parser),
    as ``mlx-dflash bench`` spells it; its value goes to :func:`ensure_openblas`."""
    parser.add_argument("--blas", default="auto", choices=MODES, help=HELP)


def openblas_path():
    for p in _CANDIDATES:
        if os.path.exists(p):
            return p
    return None


def ensure_openblas(mode: str = "auto", argv=None) -> None:
    """Re-exec this process with OpenBLAS preloaded when asked and available.

    ``argv``: the command line to re-run (default: this interpreter + sys.argv).
    """
    release_sigint()  # this may be the re-run: a Ctrl-C held since the exec arrives now
    if platform.system() != "Linux":
        return
    pre = os.environ.get("LD_PRELOAD", "")
    if mode == "bundled":
        if "openblas" in pre:  # preloaded by the command line entry: run again without it
            env = dict(os.environ, LD_PRELOAD=" ".join(p for p in pre.split() if "openblas" not in p))
            _reexec(argv or [sys.executable] + sys.argv, env)
        return
    lib = openblas_path()
    if lib is None:
        if mode == "openblas":
            from .errors import DFlashError

            raise DFlashError("OpenBLAS not found: apt-get install libopenblas0-pthread")
        return
    if lib in pre:
        set_threads()
        return
    env = dict(os.environ, LD_PRELOAD=f"{lib} {pre}".strip())
    _reexec(argv or [sys.executable] + sys.argv, env)


def release_sigint() -> None:
    """Let SIGINT in again after :func:`_reexec` held it (a no-op otherwise)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _reexec(argv, env) -> None:
    """Replace this process by ``argv`` with SIGINT held: a Ctrl-C while the
    new interpreter starts (before it can raise KeyboardInterrupt) would end
    it with a fatal error and a traceback. The mask survives the exec; the
    re-run releases it (:func:`release_sigint`), and a Ctrl-C held meanwhile
    then arrives as a KeyboardInterrupt."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    os.execve(argv[0], argv, env)


def _openblas():
    """The loaded OpenBLAS's thread controls (a preloaded library is in the
    process's global namespace), or None."""
    try:
        lib = ctypes.CDLL(None)
        lib.openblas_set_num_threads.argtypes = [ctypes.c_int]
        lib.openblas_get_num_threads.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def decode_threads() -> int:
    """BLAS threads for decoding: :func:`cores` less one for the Python
    thread that queues the next step."""
    return max(1, cores() - 1)


def set_threads(n=None) -> None:
    """Give the loaded OpenBLAS ``n`` threads (default :func:`decode_threads`); no-op without it."""
    lib = _openblas()
    if lib is not None:
        lib.openblas_set_num_threads(n or decode_threads())


def describe() -> str:
    if platform.system() == "Darwin":
        return "Apple Accelerate / Metal (macOS)"
    pre = os.environ.get("LD_PRELOAD", "")
    if "openblas" in pre:
        lib = _openblas()
        n = lib.openblas_get_num_threads() if lib is not None else None
        return f"OpenBLAS preloaded ({pre})" + (f", {n} thread{'s' if n != 1 else ''}" if n else "")
    return "mlx-cpu bundled reference BLAS (OpenBLAS not preloaded)"
