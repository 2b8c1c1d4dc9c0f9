"""Implementation details of Slipstream; the public API is ``slipstream``."""
