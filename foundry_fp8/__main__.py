"""`python -m foundry_fp8 ...` is the `foundry-fp8` command: the same subcommands, messages and
exit codes, for an environment whose scripts folder is not on PATH."""

import sys

from foundry_fp8.cli import main

if __name__ == "__main__":
    sys.exit(main())
