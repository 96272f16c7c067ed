"""The notebook's handle on the ranks: an ipyparallel `Cluster` and the `Run`s it starts."""

from workbench.cluster.cluster import Cluster, ClusterError
from workbench.cluster.run import RankError, Run

__all__ = ["Cluster", "ClusterError", "RankError", "Run"]
