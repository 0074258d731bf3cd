"""Agents on the reversible window (web, long video, documents). Layer 5: imports agentwin only.

- `agents.base`: `Observation`, the `Env` protocol, `ActionError`, `EnvError`.
- `agents.loop`: `AgentLoop`, the step loop every agent shares, and its records and summary.
- `agents.model`: `Decider` (window + prompt -> reply), `WindowDecider`, `ScriptedDecider`.
- `agents.actions`: tolerant parsing of the model's JSON actions.
- `agents.doc`: `PdfEnv`, the document navigator; `agents.web`: `BrowserEnv`; `agents.video`: `VideoEnv`.
"""
