"""What a control process runs as its own children on one machine: supervised processes that die
with it (`children`), and the local gateway, Envoy in front of two extprocs, with the one check of
when it serves (`gateway`). `wakegate up` and the federation's global gateway both stand on it."""
