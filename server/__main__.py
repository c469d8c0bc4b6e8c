"""`python -m server [serve flags]` is `specserve serve [flags]`."""

import sys

from server.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
