"""`python -m pagedserve.entrypoints.server`: the same as `pagedserve serve`."""

import argparse

from pagedserve.entrypoints.server.api_server import add_serve_args, run_server

if __name__ == "__main__":
    run_server(add_serve_args(argparse.ArgumentParser(prog="pagedserve serve")).parse_args())
