"""OpenAI-compatible HTTP server: the app and `run_server` (api_server.py), the `serve`
command's options (options.py, light: the CLI parses them and starts the engine core before it
imports the rest)."""
