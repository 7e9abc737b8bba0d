#!/usr/bin/env python3
"""`python benchmarks/run.py [options]`: the same as `python -m benchmarks [options]` from the repository root."""

import sys
from pathlib import Path

if __name__ == "__main__":
    # Python put this script's folder first on sys.path; the package needs the folder above it
    # there instead (which also keeps this folder's modules from shadowing top-level ones).
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    from benchmarks.cli import main

    main()
