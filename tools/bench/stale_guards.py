"""Stale-patch guards that `agentwin bench fidelity` compares with the window's own
(`origin-similar`, `origin-akin`, `agentwin.patches.policies`): when to serve a chunk's origin
patch after an antecedent it was not fitted for, and when to fall back to blind reuse.

- `origin-neighbour`: only after the same chunk right before it as at its origin;
- `origin-present`: only while every chunk before it at its origin is before it still;
- `origin-either`: where either holds (`agentwin.patches.policies.origin_holds`, the test the
  window's guards start from).

They are patch policies like the window's (`Window(patch=policy_named(name))`), kept here
because only the study runs them; `policy_named` also builds the orbit policy
(`tools.bench.orbit`).
"""

from __future__ import annotations

from typing import Any, Sequence

from agentwin.patches.host import Fallback, Host
from agentwin.patches.policies import POLICY_TYPES, PatchPolicy, origin_holds
from tools.bench.orbit import OrbitPolicy


class _Guard(PatchPolicy):
    """The origin patch where `holds`, else blind reuse."""

    def holds(self, keys: tuple, origin: tuple) -> bool:
        raise NotImplementedError

    def unseen(self, host: Host, chunk: Any, antecedent_ids: Sequence) -> Fallback:
        if chunk.origin and not self.holds(host.keys(antecedent_ids), chunk.origin):
            return Fallback(None, False)
        return super().unseen(host, chunk, antecedent_ids)


class OriginNeighbour(_Guard):
    name = "origin-neighbour"

    def holds(self, keys: tuple, origin: tuple) -> bool:
        return keys[-1:] == origin[-1:]


class OriginPresent(_Guard):
    name = "origin-present"

    def holds(self, keys: tuple, origin: tuple) -> bool:
        return set(origin) <= set(keys)


class OriginEither(_Guard):
    name = "origin-either"

    def holds(self, keys: tuple, origin: tuple) -> bool:
        return origin_holds(keys, origin)


GUARDS = {p.name: p for p in (OriginNeighbour, OriginPresent, OriginEither)}


def policy_named(name: str, *args: Any) -> Any:
    """The policy object for `name`: one of these guards, the orbit policy, or one of the window's policies
    (configured with `args`, e.g. a threshold); a name the window takes as it is is returned as
    such when no args are given."""
    if name in GUARDS:
        return GUARDS[name](*args)
    if name == OrbitPolicy.name:
        return OrbitPolicy(*args)
    if args:
        return POLICY_TYPES[name](*args)
    return name
