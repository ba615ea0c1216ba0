"""The trainer's named choices, as plain ``Literal`` types.

They live apart from the config sections that validate them (``_config``, pydantic) so
that the trainer's core (the loss, the sharding) imports without pydantic: the GPU check
(``scripts/gpu-check.sh``) runs it in a stock CUDA image that has none.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["Aggregation", "BatchLayout", "Correction", "FailureRule", "StaleRule"]

Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
BatchLayout = Literal["packed", "padded"]
StaleRule = Literal["drop", "reweight"]
FailureRule = Literal["exclude", "retry"]
Correction = Literal["none", "tis", "mis"]
