"""Turning scheduler decisions into device tensors and running the model on them."""
