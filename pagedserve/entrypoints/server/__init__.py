"""OpenAI-compatible HTTP server: `build_app`, plus `add_serve_args`/`run_server` for the CLI."""

from pagedserve.entrypoints.server.api_server import add_serve_args, build_app, run_server

__all__ = ["add_serve_args", "build_app", "run_server"]
