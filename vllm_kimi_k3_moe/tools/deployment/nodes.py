"""How a Kimi-K3 deployment spreads over nodes in vLLM's multiprocessing launch.

vLLM 0.33.0 runs one model over N nodes when every node runs ``vllm serve``
with ``--nnodes N --node-rank R --master-addr ADDR`` (node 0's address), the
nodes other than 0 with ``--headless`` (no API server). Its rules, restated
here in plain Python (the command line checks them before vLLM is imported)
and held to vLLM's by ``tests/upstream_contract/test_multi_node_vllm.py``:

- ``EngineArgs.create_engine_config``: ``--nnodes`` above 1 needs the ``mp``
  data-parallel backend; the world size (TP x PP x PCP x DP) must be
  divisible by ``--nnodes``, every node then running world / N GPUs; the node
  rank is in [0, N); each node runs ``max(GPUs per node // (TP x PP x PCP),
  1)`` data-parallel ranks.
- ``ParallelConfig.nnodes_within_dp``: the nodes are split evenly among the
  data-parallel replicas' node groups, so a node holds whole replicas or a
  replica spans whole nodes.

``node_split`` picks the fewest nodes of at most ``gpus_per_node`` GPUs each
that vLLM accepts for a layout; ``tools/plan/serve_command.py`` writes each
node's line from it and ``tools/meta_rank/vllm_config.py`` builds the
``ParallelConfig`` node 0's line makes.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kimi_k3_moe.tools.deployment.topology import DeploymentError, Topology

# GPUs per node when plan is not told (--gpus-per-node): an HGX/DGX node.
DEFAULT_GPUS_PER_NODE = 8
# --master-addr in the lines plan prints: node 0's address, for the operator
# to fill in (vLLM takes any string; the nodes connect to it at start-up).
HEAD = "HEAD"
# vLLM's only data-parallel backend that takes --nnodes (and its default).
MULTI_NODE_DP_BACKEND = "mp"


@dataclass(frozen=True)
class NodeSplit:
    """A layout over ``nodes`` nodes of ``gpus_per_node`` GPUs each, as
    vLLM's multiprocessing launch runs it."""

    nodes: int
    gpus_per_node: int  # GPUs each node runs: the world size / nodes
    dp_per_node: int  # data-parallel ranks each node runs, as vLLM infers it

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


def _replica(topology: Topology) -> int:
    """GPUs of one data-parallel replica (TP x PP; PCP is 1 for Kimi-K3)."""
    return topology.tp_size * topology.pp_size


def split_over(topology: Topology, nodes: int) -> NodeSplit:
    """``topology`` over ``nodes`` nodes, or ``DeploymentError`` with the
    rule vLLM applies (``EngineArgs.create_engine_config``,
    ``ParallelConfig.nnodes_within_dp``), in its words."""
    world, replica = topology.gpus, _replica(topology)
    if nodes < 1:
        raise DeploymentError(f"--nnodes must be at least 1, got {nodes}")
    if world % nodes:
        raise DeploymentError(
            f"--nnodes {nodes} must evenly divide the total world size ({world}) "
            f"of {topology.label()}"
        )
    local = world // nodes
    dp_per_node = max(local // replica, 1) if nodes > 1 else topology.dp_size
    node_groups = topology.dp_size // dp_per_node
    if nodes % node_groups:
        raise DeploymentError(
            f"--nnodes {nodes} must be divisible by the number of data parallel "
            f"node groups ({node_groups}) of {topology.label()}: each node runs "
            f"{local} GPUs, which neither hold whole data-parallel replicas of "
            f"{replica} GPUs nor split one evenly"
        )
    return NodeSplit(nodes, local, dp_per_node)


def node_split(topology: Topology, gpus_per_node: int) -> NodeSplit:
    """The fewest nodes of at most ``gpus_per_node`` GPUs that vLLM's launch
    takes for ``topology`` (one GPU per node always is)."""
    if gpus_per_node < 1:
        raise DeploymentError(
            f"--gpus-per-node must be a positive number of GPUs, got {gpus_per_node}"
        )
    world = topology.gpus
    for nodes in range(-(-world // gpus_per_node), world + 1):
        try:
            return split_over(topology, nodes)
        except DeploymentError:
            continue
    raise AssertionError("one GPU per node always splits")  # pragma: no cover


def validate_node_rank(nodes: int, node_rank: int) -> None:
    """Refuse a node rank outside [0, nodes), as ``EngineArgs`` does."""
    if not 0 <= node_rank < nodes:
        raise DeploymentError(
            f"--node-rank must be between 0 and {nodes - 1}; got --node-rank "
            f"{node_rank}"
        )


def validate_launch(
    topology: Topology, nnodes: int, node_rank: int, data_parallel_backend: str
) -> NodeSplit:
    """What a serve line's ``--nnodes``, ``--node-rank`` and
    ``--data-parallel-backend`` ask of ``topology``, refused as vLLM refuses
    it (``EngineArgs.create_engine_config``); the split it asks for."""
    if nnodes > 1 and data_parallel_backend != MULTI_NODE_DP_BACKEND:
        raise DeploymentError(
            f"--nnodes {nnodes} requires --data-parallel-backend "
            f"{MULTI_NODE_DP_BACKEND}; got --data-parallel-backend "
            f"{data_parallel_backend}"
        )
    split = split_over(topology, nnodes)
    validate_node_rank(nnodes, node_rank)
    return split
