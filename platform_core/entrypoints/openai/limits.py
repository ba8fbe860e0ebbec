"""Server settings shared by the ``serve`` flags and the server itself (kept import-light)."""

DEFAULT_MAX_BODY_BYTES = 8 << 20
API_KEY_ENV = "PLATFORM_CORE_API_KEY"
