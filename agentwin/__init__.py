"""agentwin: multimodal agents with a reversible context window (see docs/DESIGN.md)."""

__version__ = "0.1.0"

from agentwin.models.adapter import KameraModel  # noqa: E402
from agentwin.window import ChunkId, Frames, Image, Text, Window  # noqa: E402
from agentwin.window_config import WindowConfig  # noqa: E402
from agentwin.chat import Chat  # noqa: E402

__all__ = ["Chat", "ChunkId", "Frames", "Image", "KameraModel", "Text", "Window", "WindowConfig", "__version__"]
