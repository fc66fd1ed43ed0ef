"""`wakegate up`: the whole product on one machine (main.py), and the local pieces it runs."""
