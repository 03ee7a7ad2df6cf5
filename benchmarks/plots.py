"""What every benchmark's plot starts with: matplotlib's pyplot on the file-only backend, or None (and a
note) where matplotlib is not installed (it comes with the `bench` extra)."""

from __future__ import annotations

import sys


def pyplot():
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
