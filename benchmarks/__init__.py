"""effgrad benchmarks: `python -m benchmarks run [--quick] [SUITE ...]`."""
