"""clusterdns: cluster DNS and Service proxy rules in one node agent."""

__version__ = "0.1.0"
