"""Benchmarks above training: the dry run of one rank of a real-size job."""
