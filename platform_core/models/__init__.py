"""Model definitions, weight loading, and model-path resolution."""
