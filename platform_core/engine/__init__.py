"""The engine loop: schedule, execute, postprocess."""
