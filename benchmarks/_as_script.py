"""Imported first by a benchmark run as a script (``python benchmarks/run.py``), never as a module.

It puts the repository *last* on ``sys.path`` so that ``benchmarks.*`` imports while an installed
``dcp_datastates`` (with its compiled engine) wins over the source tree, and it removes the
script's own directory, which must not shadow other modules. Usage, before any
``benchmarks.*`` import::

    if __package__ in (None, ""):
        import _as_script  # noqa: F401
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    del sys.path[0]
if os.path.dirname(_HERE) not in sys.path:
    sys.path.append(os.path.dirname(_HERE))
