"""Cluster DNS: names, the zone view compiled from the state, and the answer engine."""
from .engine import Engine, Forwarder

__all__ = ["Engine", "Forwarder"]
