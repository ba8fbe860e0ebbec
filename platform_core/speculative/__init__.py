"""Speculative decoding: cheap proposals (prompt lookup, a draft model), verified by the target
model in one forward pass (the verification itself is sampling: ``sample/draft_verify.py``)."""
