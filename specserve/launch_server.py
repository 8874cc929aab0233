"""``python -m specserve.launch_server --model-path ... [SGLang flags]``: the HTTP server.

Two processes, as SGLang arranges them: this one (the front) serves HTTP with uvicorn,
tokenizes and detokenizes; the model process (``server/model_process.py``) runs the
scheduler and the model as its main thread. They talk over ZMQ (``server/ipc.py``). The
URL is printed once the model is loaded and the socket is listening.
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from specserve.config import ConfigError, ServerArgs

logger = logging.getLogger("specserve")
READY_MESSAGE = "The server is fired up and ready to roll!"
GRACEFUL_SHUTDOWN_S = 15   # SIGTERM/SIGINT: in-flight requests get this long to finish, then abort


def build_parser(prog: str = "python -m specserve.launch_server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, usage="%(prog)s [--model-path MODEL] [--speculative-algorithm ALGO] [options]",
        description="specserve: an OpenAI-compatible LLM server built around speculative decoding. "
                    "Flags follow SGLang's launch_server; see README.md for usage.")
    ServerArgs.add_cli_args(parser)
    return parser


def parse_server_args(argv: Sequence[str] | None, parser: argparse.ArgumentParser | None = None) -> ServerArgs:
    """Parse flags into ServerArgs; a bad flag prints ``error: <message>`` and exits 2."""
    namespace = (parser or build_parser()).parse_args(argv)
    try:
        return ServerArgs.from_cli_args(namespace)
    except ConfigError as exc:
        exit_with_config_error(exc)


def exit_with_config_error(exc: ConfigError) -> None:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="[%(asctime)s %(levelname)s %(name)s] %(message)s",
                        datefmt="%H:%M:%S")


def server_url(server_args: ServerArgs) -> str:
    host = server_args.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{server_args.port}"


def build_app(server_args: ServerArgs) -> Any:
    """Start the model process, then build the FastAPI app on its client. A model that cannot
    start ends this process with one ``error:`` line (exit 2 for a flag's fault, else 1)."""
    from specserve.server.api import create_app
    from specserve.server.engine_client import EngineClient, StartupError

    try:
        client = EngineClient.launch(server_args)
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2 if exc.is_config_error else 1)
    return create_app(client, server_args)


def run_server(server_args: ServerArgs) -> None:
    import uvicorn

    from specserve.runner.gc_freeze import freeze_long_lived_objects

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                freeze_long_lived_objects("front")
                print(f"{READY_MESSAGE} Serving on {server_url(server_args)}", flush=True)

    app = build_app(server_args)
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                            log_level=server_args.log_level.lower(), timeout_keep_alive=5,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    AnnouncingServer(config).run()


def main(argv: Sequence[str] | None = None) -> None:
    server_args = parse_server_args(argv)
    configure_logging(server_args.log_level)
    logger.info("server args: %s", {k: v for k, v in vars(server_args).items() if k != "api_key"})
    run_server(server_args)


if __name__ == "__main__":
    main()
