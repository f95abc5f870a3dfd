"""Run first by a benchmark started as a script (``python benchmarks/run.py``), never imported.

It puts the repository *last* on ``sys.path`` so that ``benchmarks.*`` imports while an installed
``dcp_datastates`` (with its compiled engine) wins over the source tree, and it removes the
script's own directory, which must not shadow other modules. Run by path, not imported: a
spawned worker re-runs its parent's script with the parent's ``sys.path``, which no longer has
this directory. Usage, before any ``benchmarks.*`` import::

    if __package__ in (None, ""):
        import runpy

        runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_script.py"))
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    del sys.path[0]
if os.path.dirname(_HERE) not in sys.path:
    sys.path.append(os.path.dirname(_HERE))
