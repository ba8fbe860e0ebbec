"""``platform-core proxy``: one OpenAI-compatible front for prefill and decode instances
(disaggregated serving). A pure HTTP front: it never imports the engine."""
