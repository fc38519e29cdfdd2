"""`python -m loraplane` is the `loraplane` command."""

import sys

from loraplane.cli import main

sys.exit(main())
