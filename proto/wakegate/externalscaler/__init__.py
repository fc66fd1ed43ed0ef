"""KEDA's externalscaler.proto, verbatim, and its generated modules.

Copied from github.com/kedacore/keda/v2 v2.20.2, pkg/scalers/externalscaler. The proto
package stays `externalscaler`, so the service on the wire is `externalscaler.ExternalScaler`.
"""
