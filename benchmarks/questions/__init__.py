"""One module per question of benchmarks/run_all.py; common.py holds what they share."""
