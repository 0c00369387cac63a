"""``python -m ple_um.cli``: the `ple-um` command."""

import sys

from ple_um.cli import main

sys.exit(main())
