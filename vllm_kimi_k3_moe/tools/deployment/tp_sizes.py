"""The tensor-parallel sizes that work, said where one does not.

A topology vLLM cannot build is refused in one line naming the rule
(``topology.validate_topology``); where the tensor-parallel size is what
breaks it, the line also lists the sizes that build with the rest of the
layout kept, tried by the same rules, so the next command can be right.
Every tool refuses a layout so (``validate_deployment``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vllm_kimi_k3_moe.tools.deployment.topology import (
    Deployment,
    DeploymentError,
    Topology,
    validate,
    validate_topology,
)

# No TP size beyond the attention heads builds (whole heads per rank): the
# sizes tried when a config does not give its heads.
MOST_TP_TRIED = 1024


def working_tp_sizes(text_config: dict[str, Any], topology: Topology) -> list[int]:
    """Every tensor-parallel size ``validate_topology`` lets through with
    ``topology``'s other sizes (its DCP dropped: it must divide TP)."""
    heads = text_config.get("num_attention_heads")
    most = heads if isinstance(heads, int) and heads > 0 else MOST_TP_TRIED
    working = []
    for tp in range(1, most + 1):
        try:
            validate_topology(text_config, replace(topology, tp_size=tp, dcp_size=1))
        except DeploymentError:
            continue
        working.append(tp)
    return working


def validate_with_working_tp_sizes(
    text_config: dict[str, Any], topology: Topology
) -> None:
    """``validate_topology``; its refusal, where another TP size would build
    the layout, followed by the sizes that would."""
    try:
        validate_topology(text_config, topology)
    except DeploymentError as error:
        working = working_tp_sizes(text_config, topology)
        if topology.tp_size in working or not working:
            raise  # not the TP size: another rule, said alone
        # the rest of the layout: its label without the TP size in front
        kept = replace(topology, dcp_size=1).label().partition(" ")[2]
        raise DeploymentError(
            f"{error}; TP sizes that work{f' with {kept}' if kept else ''}: "
            f"{', '.join(map(str, working))}"
        ) from None


def validate_deployment(text_config: dict[str, Any], deployment: Deployment) -> None:
    """``topology.validate``, as every tool refuses a layout: where the
    tensor-parallel size is what breaks it, the refusal lists the sizes
    that work (``validate_with_working_tp_sizes``)."""
    try:
        validate(text_config, deployment)
    except DeploymentError:
        validate_with_working_tp_sizes(text_config, deployment)
        raise
