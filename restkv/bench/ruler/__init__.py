"""RULER: offline data generation, the prediction run, and scoring."""
