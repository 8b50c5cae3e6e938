"""Machinery the tests and the benchmarks share: running a function on N local ranks with a hard time limit."""
