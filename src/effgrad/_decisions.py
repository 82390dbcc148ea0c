"""What one block of an automatic feature decided for each layer it met, in one line.

``effgrad.recompute_activations`` and ``effgrad.efficient_attention`` yield one of these: ``decisions``
maps a layer's path to ``(applied, why)``; ``applied`` tells whether any layer took the feature;
``reason`` groups the layers by decision, three named per group.
"""

from __future__ import annotations

__all__ = ["LayerDecisions"]


class LayerDecisions:
    """A subclass names its feature: ``OFF`` (the reason when the mode is False), ``NONE`` (no layer met),
    ``WORDS`` (what an applied and a declined layer is called in the reason)."""

    OFF = NONE = ""
    WORDS = ("applied", "not applied")

    def __init__(self, mode):
        self.mode = mode
        self.decisions: dict[str, tuple[bool, str]] = {}

    @property
    def applied(self) -> bool:
        return any(done for done, _ in self.decisions.values())

    @property
    def reason(self) -> str:
        if self.mode is False:
            return self.OFF
        if not self.decisions:
            return self.NONE
        groups: dict[tuple[bool, str], list[str]] = {}
        for name, decision in self.decisions.items():
            groups.setdefault(decision, []).append(name)
        parts = []
        for (done, why), names in groups.items():
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            parts.append(f"{self.WORDS[0] if done else self.WORDS[1]} in {shown}: {why}")
        return "; ".join(parts)
