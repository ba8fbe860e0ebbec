"""The engine loop: schedule, execute, postprocess.

``ENGINE_MODES``: where a front runs the engine core (``engine.launch.start_engine``), kept here
so the CLI can list them without importing the engine.
"""

ENGINE_MODES = ("process", "thread")
