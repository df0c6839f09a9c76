"""RULER: offline data generation, prediction records and scoring."""
