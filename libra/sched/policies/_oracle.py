"""The oracles: C-MLFQ's rules fed the truth a real run never has (only the benchmark,
which scripted the workload, can build them). They are references for the benchmark's
``x oracle``, not policies.
"""

from __future__ import annotations

from typing import ClassVar

from libra.sched._buckets import Router
from libra.sched.policies._base import PolicyOptions, RoutedPolicy, Truth
from libra.sched.policies._cmlfq import CMLFQ, CMLFQConfig
from libra.sched.policies._predict import OraclePredictor


class Oracle(CMLFQ):
    """Libra's ``finish`` rule fed the truth: each trajectory's remaining output and the
    seconds its tool calls still take, from its first call on. What this routing would
    do if it knew the future; the reference ``x oracle`` is against. Not a policy."""

    name: ClassVar[str] = "oracle"
    needs_truth: ClassVar[bool] = True
    knows_tool_seconds: ClassVar[bool] = True

    def __init__(self, router: Router, truth: Truth) -> None:
        predictor = OraclePredictor(truth, tool_seconds=self.knows_tool_seconds)
        super().__init__(router, self.oracle_config(), predictor=predictor)

    @classmethod
    def oracle_config(cls) -> CMLFQConfig:
        return CMLFQConfig()

    @classmethod
    def create(cls, router: Router, options: PolicyOptions) -> RoutedPolicy:
        return cls(router, _truth(cls.name, options))


class OracleFinish(Oracle):
    """The ``finish`` rule fed the true remaining output but not the tool seconds: what a
    perfect predictor of lengths alone would buy."""

    name: ClassVar[str] = "oracle-finish"
    benchmarked_by_default: ClassVar[bool] = False
    knows_tool_seconds: ClassVar[bool] = False


class OracleSimple(Oracle):
    """C-MLFQ's simple rule fed the true remaining length (the reference's oracle).
    Knowing the truth, it needs no agreement of mean and p90 and places a trajectory from
    its first call on."""

    name: ClassVar[str] = "oracle-simple"
    benchmarked_by_default: ClassVar[bool] = False
    knows_tool_seconds: ClassVar[bool] = False

    @classmethod
    def oracle_config(cls) -> CMLFQConfig:
        return CMLFQConfig(
            rule="simple", priority="none", start_in_shortest=False, quantum_tokens=None
        )


def _truth(name: str, options: PolicyOptions) -> Truth:
    if options.truth is None:
        raise ValueError(f"{name} needs the true lengths (truth=...)")
    return options.truth
