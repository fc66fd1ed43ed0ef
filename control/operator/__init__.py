"""`wakegate operator`: the Kubernetes operator for Model, InferenceRuntime, ModelCache, ModelCatalog and
LoRAAdapter (Kopf, leader-elected).

main.py is the process (leader election, Kopf lifecycle); controller.py holds the watches and
the applies; render.py and status.py are pure.
"""
