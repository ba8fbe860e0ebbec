"""The ``platform-core`` command: one parser module per subcommand, above every other layer."""
