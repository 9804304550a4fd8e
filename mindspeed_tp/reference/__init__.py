"""Single-device reference: the model of the bundled architectures and a rollout-engine stand-in."""
from .engine import PagedKVCache, ReferenceEngine, Request
from .model import ReferenceModel

__all__ = ["PagedKVCache", "ReferenceEngine", "ReferenceModel", "Request"]
