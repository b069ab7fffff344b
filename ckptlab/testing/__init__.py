"""Test helpers for ckptlab and for code that uses it.

``ckptlab.testing.strategies`` holds hypothesis strategies that generate random torch objects
(state dicts with views, shared storages, every dtype torch.save writes) and random
``torch.save`` configurations. It imports torch and hypothesis, so it is only imported by tests;
importing this package imports neither.
"""

__all__: list[str] = []
