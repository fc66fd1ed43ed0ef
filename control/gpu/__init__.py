"""Accelerator discovery: the seam between the node agent and vendor libraries.

A :class:`Discovery` lists the GPUs of this machine as :class:`GpuDevice` values. NVIDIA comes
from NVML (`pynvml`, the nvidia-ml-py package, :mod:`wakegate.control.gpu.nvml`), AMD from `amdsmi`
(:mod:`wakegate.control.gpu.amd`, used when importable), and :mod:`wakegate.control.gpu.fake` serves tests and
demos. :func:`probe` opens every vendor library that works here and explains the ones that do
not, so "no GPU" and "no library" end in a log line, never in an exception.
"""
