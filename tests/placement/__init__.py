"""Unit and component tests of GPU placement: rules, extender HTTP, node agent, discovery, bench."""
