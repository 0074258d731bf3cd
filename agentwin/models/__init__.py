"""Model adapters: the only part of agentwin that imports transformers."""
