"""The OpenAI-compatible HTTP server (``platform-core serve``)."""
