"""Ctrl-C sent to a child process, as a user presses it."""

import signal
import subprocess


def interrupt(p: subprocess.Popen, tries: int = 3, wait: float = 15.0) -> None:
    """Send SIGINT to ``p`` until it exits, at most ``tries`` times, ``wait``
    seconds apart. Under a loaded machine a single Ctrl-C was now and then
    lost (the chat REPL at its prompt read EOF and exited 0; the server went
    on serving; cause not found): a second one is sent, as a user would press,
    and the test checks how the child ends."""
    for _ in range(tries):
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass
