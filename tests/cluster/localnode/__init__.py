"""A local node for the Kubernetes API emulator: runs the pods of Deployments, StatefulSets
and bare Pods as local processes, one network namespace per pod (see tests/cluster/README.md).
"""

from . import network
from .api import ApiError
from .node import LocalNode, local_node

__all__ = ["ApiError", "LocalNode", "local_node", "network"]
