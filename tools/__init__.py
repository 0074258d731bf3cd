"""Command-line tools of the agentwin project (`agentwin` CLI: demo, benchmarks)."""
