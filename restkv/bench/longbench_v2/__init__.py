"""LongBench v2: data, the official prompt and answer extraction, evaluation by difficulty and length, the run."""
