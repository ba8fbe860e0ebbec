"""Helpers shared by the output parsers (reasoning and tool calls): a registry of parser classes
by name, extensible through entry points (``plugin_registry``), and a driver that resumes an
incremental text parser across a stream's calls (``resumable``)."""
