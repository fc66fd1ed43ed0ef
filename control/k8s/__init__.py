"""Kubernetes-facing pieces of control/: names and labels shared by every component that touches a cluster."""
