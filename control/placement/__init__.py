"""GPU-aware placement as pure functions: no I/O, no Kubernetes client.

- :mod:`control.placement.facts`: what the rules read from Node and Pod objects (plain dicts,
  the JSON kube-scheduler sends), with the annotation names wakegate defines for placement;
- :mod:`control.placement.rules`: the extender's filter rules and score formula;
- :mod:`control.placement.benchdata`: bench results as stored in the results ConfigMap.

The HTTP adapter is :mod:`control.extender`; the node agent that writes the node facts is
:mod:`control.agent`; the bench that writes the results is :mod:`control.bench`.
"""
