"""Tests of `wakegate scaler`: demand book, verdicts, KEDA protocol, up --scaler-listen."""
