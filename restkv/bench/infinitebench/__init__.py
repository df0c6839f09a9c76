"""InfiniteBench: task tables, scorers and evaluation."""
