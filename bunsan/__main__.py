"""``python -m bunsan``: the same as the ``bunsan`` command."""

from __future__ import annotations

import sys

from bunsan.cli import main

if __name__ == "__main__":
    sys.exit(main())
