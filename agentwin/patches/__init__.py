"""What a chunk gets at a placement the window did not compute, and how its patches are fitted.

- `policies`: the placement policies behind `Window(patch=...)` (exact, survive, refresh, the
  patch policies), one object each behind `place` / `passed`;
- `host`: the narrow view of the window a policy is lent (`Host`) and the values they exchange;
- `fit`: the window's patch settings (`PatchSettings`) and how a chunk's patch is fitted from a
  pass it ran anyway;
- `guard`: the patch guard (keep a component only where it beats blind reuse) and the KL ladder.

No module here imports the window's (`agentwin.window`, `agentwin.window_engine`).
"""
