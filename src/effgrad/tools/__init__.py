"""Tools around training: device memory (measuring, budgets), diagnostics, privacy accounting."""
