"""`wakegate scheduler-extender`: the process (main.py), its HTTP handlers (server.py) and cluster mirrors (kube.py)."""
