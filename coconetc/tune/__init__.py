"""The autotuner (not built yet): picks the fastest legal schedule."""
