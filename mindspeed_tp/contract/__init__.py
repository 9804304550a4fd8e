"""The numerics contract: its parameters (``profile``), the canonical tree (``tree``) and every
setting that cannot keep it (``refusals``). The rules in prose: docs/CONTRACT.md."""
