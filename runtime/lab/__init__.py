"""The measurement lab: timing, bench, targets, tune, plots, the copy yardstick and the serving
simulation. It imports the library; nothing in the library imports it."""
