"""`WindowConfig`: every setting of a window but its model and store, checked once.

`Window(km, config)` takes one; `Window(km, budget_tokens=..., patch=...)` builds one from the
keywords (the same names), so the two read alike:

    Window(km, WindowConfig(budget_tokens=2048, evict="lru"), store=store)
    Window(km, budget_tokens=2048, evict="lru", store=store)

What needs the model (the patch settings: a fit the model's layers cannot take) is checked when
the window is built (`agentwin.patches.fit.patch_settings`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from agentwin.eviction import EVICTIONS
from agentwin.patches.fit import BUDGET
from agentwin.patches.policies import DEFAULT_POLICY, PATCH_POLICIES, POLICIES, POLICY_TYPES, Exact, PatchPolicy

# The settings that shape the patches of a patch policy, and their defaults.
PATCH_SETTINGS = {"rank": BUDGET, "patch_bytes": None, "storage": "auto", "guard": "auto", "max_kl": None,
                  "fit": "residual"}


@dataclass(frozen=True)
class WindowConfig:
    """budget_tokens: the most tokens the window holds; past it an append or a recall evicts
    unpinned chunks, `evict` ("fifo", "lru" or "relevant", `agentwin.eviction`) saying which first.
    patch: "exact" (the default: every placement the model's own KV, as a re-prefill), "survive",
    "refresh", a patch policy ("origin-akin", ...), or a configured policy object such as
    `agentwin.patches.policies.Refresh(near_tokens=64)`.
    The rest sets the patches of the patch policies (`agentwin.patches.fit`): rank "budget" (each
    chunk's patch at most `patch_bytes`, default 0.06, of its canonical KV bytes), an int (the
    bytes of that rank in every layer) or None (exact patches); fit (how the bytes are spread,
    "residual"), storage (the factors' form, "auto"), guard (keep a patch only where it beats
    blind reuse, `agentwin.patches.guard`) and max_kl (a next-token KL target per text chunk
    instead of a byte budget)."""

    budget_tokens: int = 8192
    patch: str | Exact = DEFAULT_POLICY
    evict: str = "fifo"
    rank: int | str | None = BUDGET
    patch_bytes: float | None = None
    storage: str = "auto"
    guard: bool | str = "auto"
    max_kl: float | None = None
    fit: str = "residual"

    def __post_init__(self) -> None:
        if isinstance(self.budget_tokens, bool) or not isinstance(self.budget_tokens, int) or self.budget_tokens < 1:
            raise ValueError(f"budget_tokens must be a positive int, got {self.budget_tokens!r}")
        if not isinstance(self.patch, Exact) and self.patch not in POLICIES:
            raise ValueError(f"patch must be one of {POLICIES} (or a policy object such as "
                             f"agentwin.patches.policies.Refresh(...)), got {self.patch!r}")
        if self.evict not in EVICTIONS:
            raise ValueError(f"evict must be one of {tuple(EVICTIONS)}, got {self.evict!r}")
        given = [name for name, default in PATCH_SETTINGS.items()
                 if getattr(self, name) != default and not (name == "rank" and getattr(self, name) is None)]
        if given and not isinstance(self.policy(), PatchPolicy):
            raise ValueError(f"{', '.join(given)} set(s) the patches of a patch policy, and patch={self.policy_name!r} "
                             f"fits none; pass patch='origin-akin' (or another patch policy: "
                             f"{', '.join(PATCH_POLICIES)}) to use them")

    @property
    def policy_name(self) -> str:
        return self.patch.name if isinstance(self.patch, Exact) else self.patch

    def policy(self) -> Exact:
        """The placement policy object (the one given, or a new one of the named kind)."""
        return self.patch if isinstance(self.patch, Exact) else POLICY_TYPES[self.patch]()

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
