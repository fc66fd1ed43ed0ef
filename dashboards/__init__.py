"""wakegate's Grafana dashboards and Prometheus alerts, as code.

`python scripts/gen_dashboards.py` renders them into the chart
(charts/wakegate/dashboards/*.json and charts/wakegate/files/alerts.yaml), the one
place they are shipped from; `--check` fails when the committed files are stale.
"""
