"""Per-role SLO autoscaling shared by every backend and the simulator: torch-free, Kubernetes-free.

The pure policy (``policy``, ``demand``), the signal registry and collector (``registry``,
``signals``, ``exposition``, ``pods``), the one autoscaler loop (``loop``), its metrics and
decision reports (``metrics``, ``report``) are used by the operator's Kubernetes backend and by
``cleave up``'s local backend; the discrete-event simulator (``simulator`` and the modules it
builds on, ``cleave simulate``) is the loop's third backend and evaluates the same policy
offline.
"""
