"""Research studies behind the window's defaults (guard, compute, refine); each writes its page
under docs/results/ through `agentwin bench` and is not part of the library."""
