"""The coverage matrix's entries, tiny configs and one entry's run (run by
benchmarks/coverage/matrix.py)."""
