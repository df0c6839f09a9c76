"""Math reasoning (MATH500, AIME 2024/2025, GSM8K): data, answer extraction and grading, the prediction run."""
