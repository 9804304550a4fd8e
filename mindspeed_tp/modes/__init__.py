"""Reduction modes beyond the canonical tree (the profile's ``reduction``)."""
