"""Moving KV blocks between instances (prefill/decode disaggregation) through connector plugins."""
