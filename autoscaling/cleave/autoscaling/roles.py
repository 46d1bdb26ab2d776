"""The two roles' names, defined once: the policy, the floor and the flip planner share them
(a module of its own so that the policy can use the floor without an import cycle)."""

PREFILL, DECODE = "prefill", "decode"
