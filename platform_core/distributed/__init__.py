"""Collective communication between ranks, behind a backend-supplied communicator."""
