"""The backend plugin contract (pluggy hookspecs) and the manager that discovers backends."""
