"""jobrun's benchmarks: `python benchmarks/run.py [--quick] [--json out.json]`."""
