"""Demand from the gateways: the pure book (`book`) and the gRPC service that fills it (`service`)."""
