"""Needle-in-a-Haystack.

A needle sentence is inserted at a sentence boundary at a given depth of a
haystack cut to a given length, the model answers a question about it
greedily, and the answer is scored with ROUGE-1 F (as the original) and a
graded score (numeric needles: fraction of the digits right, in order).

:mod:`.data` builds the prompts, :mod:`.metrics` scores the answers, :mod:`.run` runs the sweep (its flags:
:mod:`.flags`)
and :mod:`.report` prints and draws its results.
"""
