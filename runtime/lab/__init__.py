"""The measurement lab: timing (graph replay with cold L2, host loops, the copy yardstick), bench,
targets, tune, plots, the copy kernel, the serving simulation (simulate/) and the provenance every
result file carries. It imports the library; nothing in the library imports it."""
