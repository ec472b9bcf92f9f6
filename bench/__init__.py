"""Benchmarks of the gateway (`python -m bench <name>`); results land in bench/results/."""
