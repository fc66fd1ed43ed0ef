"""wakegate's control side: everything that decides (runtime, feeder, scaler, operator, CLI)."""
