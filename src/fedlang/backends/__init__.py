"""Backends for local computations."""
