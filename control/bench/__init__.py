"""`wakegate bench`: the process (main.py) and the measuring it does (measure.py)."""
