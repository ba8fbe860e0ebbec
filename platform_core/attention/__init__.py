"""Attention metadata built by the input builder and the pure-torch reference attention."""
