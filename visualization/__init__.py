"""Plots of the needle sweep and of what eviction keeps (:mod:`visualization.plots`)."""
