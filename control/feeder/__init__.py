"""The xDS feeder as a library: snapshot builder, snapshot cache, ADS server, and the Kubernetes source."""
