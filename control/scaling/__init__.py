"""Pure scaling decisions shared by every runtime (`wakegate up` today, Kubernetes later).

Modules here take plain values and return plain values: no I/O, no asyncio, no
clock reads. Time is always a parameter (``now``: monotonic float seconds), and
each decision also says when it could next change on its own
(``next_check_at``), so a runtime sleeps until then instead of polling.

* :mod:`control.scaling.arbitration` owns GPU groups: which member of a
  ``spec.gpu.shared`` group holds the accelerator, and when it is swapped.
* :mod:`control.scaling.autoscale` owns the replica count of one model.
"""
