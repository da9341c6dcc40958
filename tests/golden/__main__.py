"""``python -m tests.golden [--update]``: check the golden runs against values.json, or rewrite it."""

import sys

from tests.golden.runs import main

sys.exit(main())
