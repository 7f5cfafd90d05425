"""The benchmark's measuring (``verispec bench``; the command line is cli/bench.py)."""
