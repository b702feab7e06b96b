"""`python -m pagedserve.entrypoints.server`: the same as `pagedserve serve`."""

import sys

from pagedserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
