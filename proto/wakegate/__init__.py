"""wakegate: one OpenAI-compatible gateway in front of many model servers, with scale to zero.

The package has two halves that never import each other, `wakegate.extproc` (the request
path) and `wakegate.control` (everything that decides), and what both may use: the
generated protobuf contracts (`wakegate.v1`, `wakegate.externalscaler`) and the helpers
every process shares (`wakegate.process`). docs/architecture.md has the map.
"""
