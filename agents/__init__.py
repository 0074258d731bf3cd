"""Agents on the reversible window (web, long video, documents). Layer 5: imports agentwin only.

- `agents.base`: `Observation`, the `Env` protocol, `ActionError`, `EnvError`.
- `agents.loop`: `AgentLoop`, the step loop every agent shares; `agents.records`: its step records
  and the summary summed from them; `agents.fit`: observations split or cut to fit the window.
- `agents.model`: `Decider` (window + prompt -> reply), `WindowDecider`, `ScriptedDecider`.
- `agents.actions`: tolerant parsing of the model's JSON actions; `agents.grammar`: the actions'
  JSON schema and decoding held to it (xgrammar).
- `agents.doc`: `PdfEnv`, the document navigator; `agents.web`: `BrowserEnv` (`agents.web_page`,
  `agents.web_net`); `agents.video`: `VideoEnv`.
- `agents.step_timing`: where a step's time goes (`agentwin bench steps`).
"""
