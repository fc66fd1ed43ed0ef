"""End-to-end harness: a real Kubernetes control plane on loopback plus a kubelet stand-in.

Nothing in this package ships; see docs/testing.md.
"""
