"""Draft heads for speculative rollouts (EAGLE-3 heads, MTP-capable targets)."""
