"""`wakegate agent`: the GPU node agent (main.py) and the labels it writes (labels.py, pure)."""
