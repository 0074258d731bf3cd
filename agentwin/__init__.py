"""agentwin: multimodal agents with a reversible context window (see docs/DESIGN.md)."""

__version__ = "0.1.0"
