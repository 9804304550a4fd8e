"""The math of the modes beyond the canonical tree (rollout layout, bitwise training); their
strategies, which the patches call, are in ``numerics/``."""
