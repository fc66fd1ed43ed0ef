"""Pure scaling decisions shared by both appliers (`wakegate up` and `wakegate scaler`).

Modules here take plain values and return plain values: no I/O, no asyncio, no
clock reads. Time is always a parameter (``now``: monotonic float seconds), and
each decision also says when it could next change on its own
(``next_check_at``), so a runtime sleeps until then instead of polling.

* :mod:`wakegate.control.scaling.arbitration` owns GPU groups: which member of a
  ``spec.gpu.shared`` group holds the accelerator, and when it is swapped.
* :mod:`wakegate.control.scaling.autoscale` owns the replica count of one model.
* :mod:`wakegate.control.scaling.core` keeps both decisions' state across calls and turns
  summed demand into verdicts (the scaling core).
"""
