"""Unit tests of the operator pure parts (rendering, status, runtime selection) and the feeder source."""
