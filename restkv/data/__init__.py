"""Text the core reads: prompt building, the needle prompts (HeadKV's calibration and the needle
benchmark), answer F1 and nothing else; it imports no other part of restkv but ``lazy``."""
