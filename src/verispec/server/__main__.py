"""``python -m verispec.server [flags]`` = ``verispec serve [flags]``."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
