"""KEDA's external-push protocol over the scaling core: the verdict hub and the ExternalScaler service."""
