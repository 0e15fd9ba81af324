"""Benchmarks: each module has main(argv) and prints a table. Run them through train/bench.py."""
