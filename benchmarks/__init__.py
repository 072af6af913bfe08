"""casckpt benchmark program: ``python benchmarks/run.py --help``."""
