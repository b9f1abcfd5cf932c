"""policyc: a declarative precision-policy compiler for low-precision RL of LLMs (see docs/ARCHITECTURE.md)."""

__version__ = "0.1.0"  # the one place: pyproject.toml reads it, plans and artifacts carry it
