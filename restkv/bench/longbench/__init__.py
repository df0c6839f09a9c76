"""LongBench: task tables, data, metrics, evaluation, and the prediction run."""
