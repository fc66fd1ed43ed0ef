"""`wakegate scaler`: the process (main.py), its Kubernetes adapters, Lease and metrics."""
