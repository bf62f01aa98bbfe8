"""`mlx-dflash serve`: an OpenAI- and Anthropic-compatible HTTP server over one engine.

``app.py`` builds the FastAPI app (auth, limits, errors, shared request
plumbing), ``openai.py``, ``responses.py`` (OpenAI's Responses API) and
``anthropic.py`` are the API dialects,
``tools.py`` parses reasoning and tool calls out of the model's text,
``worker.py`` runs generations in arrival order (one at a time, or in a batch) and
``metrics.py`` renders Prometheus counters.
"""

import ipaddress
import logging
import socket
import sys
from pathlib import Path
from typing import Callable, Optional

from ..errors import DFlashError
from .app import Server, Settings
from .metrics import Metrics
from .routes import create_app
from .worker import Worker

__all__ = ["Settings", "build", "bind", "serve"]


def model_names(model: Optional[Path]):
    """(served id, accepted aliases) for a --model argument (None: the embedded pair)."""
    if model is None:
        return "mlx-dflash", ("default",)
    p = Path(model)
    names = {str(model), p.name, str(p.resolve())}
    return str(model), tuple(sorted(names - {str(model)}))


def build(settings: Settings, load_engine: Callable[[], object], generate_fn: Optional[Callable] = None):
    """Load the engine on its generation thread and return (app, worker);
    ``generate_fn`` replaces api.stream_generate (the pipeline's)."""
    metrics = Metrics()
    worker = Worker(
        load_engine,
        max_queue=settings.max_queue,
        metrics=metrics,
        generate_fn=generate_fn,
        prompt_cache=settings.prompt_cache,
        prompt_cache_bytes=settings.prompt_cache_bytes,
        max_batch=settings.max_batch,
        generation=settings.generation,
    )
    worker.start()
    metrics.queue_length = lambda: worker.queue_length
    metrics.running = lambda: worker.running_count
    return create_app(Server(settings, worker, metrics)), worker


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """The socket the server will listen on, bound now, before the model
    loads: an unknown host or a port in use or not ours to take is one
    DFlashError, and no other process takes the port during the load.
    Port 0 binds a free port (the socket's ``getsockname()`` says which)."""
    try:
        fam, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise DFlashError(f"--host {host}: cannot resolve it ({getattr(e, 'strerror', None) or e})") from None
    s = socket.socket(fam, kind, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        s.bind(addr)
    except OSError as e:
        s.close()
        raise DFlashError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return s


def serve(
    settings: Settings,
    load_engine: Callable[[], object],
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    log_level: str = "info",
    generate_fn: Optional[Callable] = None,
    sock: Optional[socket.socket] = None,
) -> None:
    """Serve until Ctrl-C, on ``sock`` if given (from :func:`bind`), else on ``host:port``."""
    import uvicorn

    sock = sock or bind(host, port)
    port = sock.getsockname()[1]  # the one bound, where --port 0 asked for any
    shown = f"[{host}]" if ":" in host else host
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(message)s")
    app, worker = build(settings, load_engine, generate_fn)
    if not _loopback(host) and settings.api_key is None:
        print(
            f"warning: serving on {host} without --api-key: anyone who can reach this port can use it", file=sys.stderr
        )
    print(
        f"mlx-dflash: serving '{settings.model_id}' on http://{shown}:{port} "
        "(OpenAI /v1/chat/completions, /v1/completions, /v1/responses; Anthropic /v1/messages)",
        file=sys.stderr,
        flush=True,
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # Ctrl-C ends the replies in flight first, each with its last event, so
            # the graceful shutdown finds their connections closed instead of
            # cutting them (and logging their cancelled tasks) after its timeout.
            worker.cancel_all()
            super().handle_exit(sig, frame)

    try:
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises the captured Ctrl-C again once it has shut down
        pass
    finally:
        worker.stop()
        sock.close()
