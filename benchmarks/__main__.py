"""`python -m benchmarks [options]` (from the repository root); see cli.py."""

from benchmarks.cli import main

main()
