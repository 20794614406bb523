"""Benchmarks behind `of3-megafold bench`: the kit and stock OF3 side by side."""
