"""`python -m lightning_ffpa ...`: the `lightning-ffpa` command, for launchers that start a module
(`torchrun -m lightning_ffpa fit --config ...`)."""

import sys

from lightning_ffpa.cli import main

if __name__ == "__main__":
    sys.exit(main())
