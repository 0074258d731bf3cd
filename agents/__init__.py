"""Agents on the reversible window (web, long video, documents). Layer 5: imports agentwin only."""
