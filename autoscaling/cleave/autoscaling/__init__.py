"""Per-role SLO autoscaling shared by both backends and the simulator: torch-free, Kubernetes-free.

The pure policy (``policy``, ``demand``), the signal collector (``signals``, ``pods``), its
metrics and decision reports (``metrics``, ``report``) are used by the operator's Kubernetes
backend and by ``cleave up``'s local backend; the discrete-event simulator (``simulator`` and
the modules it builds on, ``cleave simulate``) evaluates the same policy offline.
"""
