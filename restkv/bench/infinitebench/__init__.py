"""InfiniteBench: task tables, data, scorers, evaluation, and the prediction run."""
