"""`wakegate xds`: the feeder process for a cluster (main.py); the feeder itself is wakegate.control.feeder."""
