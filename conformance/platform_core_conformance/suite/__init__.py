"""The conformance checks (pytest modules), collected by ``platform-core conformance``."""
