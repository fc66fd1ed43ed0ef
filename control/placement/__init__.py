"""GPU-aware placement as pure functions: no I/O, no Kubernetes client.

- :mod:`wakegate.control.placement.facts`: what the rules read from Node and Pod objects (plain dicts,
  the JSON kube-scheduler sends), with the annotation names wakegate defines for placement;
- :mod:`wakegate.control.placement.rules`: the extender's filter rules and score formula;
- :mod:`wakegate.control.placement.benchdata`: bench results as stored in the results ConfigMap.

The HTTP adapter is :mod:`wakegate.control.extender.main`; the node agent that writes the node facts is
:mod:`wakegate.control.agent.main`; the bench that writes the results is :mod:`wakegate.control.bench.main`.
"""
