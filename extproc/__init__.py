"""wakegate's request path: the Envoy ext_proc server and everything it decides per request."""
