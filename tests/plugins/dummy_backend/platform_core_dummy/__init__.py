"""A third-party backend for tests: installed beside platform-core, found by its entry point."""
