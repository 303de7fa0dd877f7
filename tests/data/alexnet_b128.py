"""The zoo's tiny AlexNet at batch 128: one checkpoint unit (its ``features``) holds
most of its activations, so full checkpointing rebuilds nearly all of them at once
(``tests/test_memory_tracker.py``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "models"))
from alexnet import alexnet_tiny  # noqa: E402


def alexnet_b128():
    return alexnet_tiny(128)
