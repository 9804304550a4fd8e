"""The model description every part shares: architecture configs (``spec``), parallel layouts
(``layout``) and the seeded / loaded weights with their sharding rules (``weights``). The checker,
the Hugging Face bridge, the reference engine and the integrations read it; it imports none of them."""
