"""Data plane: the inference engine, workers, router and their metrics."""
