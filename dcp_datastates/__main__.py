"""``python -m dcp_datastates``: see :mod:`dcp_datastates.cli`."""

import sys

from .cli import main

sys.exit(main())
