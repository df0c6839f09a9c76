"""LongBench: task tables, metrics, evaluation, and the prediction loop shared with InfiniteBench."""
